"""Server-side strategies: [`CompressedStrategy`][fedcomp.strategies.CompressedStrategy] wraps any Message-API
strategy."""

from fedcomp.strategies.compressed import CompressedStrategy
from fedcomp.strategies.decode import decode_update

__all__ = ["CompressedStrategy", "decode_update"]
