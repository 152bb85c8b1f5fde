"""Server-side strategies: :class:`CompressedStrategy` wraps any Message-API strategy."""

from .compressed import CompressedStrategy
from .decode import decode_update

__all__ = ["CompressedStrategy", "decode_update"]
