"""Server-side strategies: [`CompressedStrategy`][fedcomp.strategies.CompressedStrategy] wraps any Message-API
strategy; the concerns it carries are configured by objects: [`Privacy`][fedcomp.strategies.Privacy],
[`PoissonSampling`][fedcomp.strategies.PoissonSampling], [`Admission`][fedcomp.strategies.Admission] and the
download's [`Download`][fedcomp.download.Download]."""

from fedcomp.download.options import Download
from fedcomp.strategies.admission import Admission
from fedcomp.strategies.compressed import CompressedStrategy
from fedcomp.strategies.decode import decode_update
from fedcomp.strategies.privacy_budget import PoissonSampling, Privacy

__all__ = ["Admission", "CompressedStrategy", "Download", "PoissonSampling", "Privacy", "decode_update"]
