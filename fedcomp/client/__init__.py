"""Client side: the ``compression_mod`` Flower mod, the compression of one update, and the
ClientApp (``fedcomp.client.app:app``)."""

from .mod import compression_mod
from .update import CompositionError, compress_update

__all__ = ["CompositionError", "compress_update", "compression_mod"]
