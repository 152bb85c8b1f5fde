"""Client side: the ``compression_mod`` Flower mod, local training, and the ClientApp
(``fedcomp.client.app:app``)."""

from .mod import CompositionError, compress_update, compression_mod

__all__ = ["CompositionError", "compress_update", "compression_mod"]
