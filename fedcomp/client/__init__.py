"""Client side: the ``compression_mod`` Flower mod, the compression of one update, and the
ClientApp (``fedcomp.app.client_app:app``)."""

from fedcomp.client.mod import compression_mod
from fedcomp.client.update import CompositionError, compress_update

__all__ = ["CompositionError", "compress_update", "compression_mod"]
