"""fedcomp.distributed: fedcomp's codecs for PyTorch data-parallel training (Flower-free).

Averaging compressed tensors across ranks (`fedcomp.distributed.exchange`); compressed outer
synchronisation every H inner steps, DiLoCo-style (`fedcomp.distributed.outer`); the codecs as a DDP
communication hook (`fedcomp.distributed.hook`: ``CompressionState``, ``compression_hook``).
"""

from fedcomp.distributed.exchange import ByteCount, CompressionError, allgather_bytes, average
from fedcomp.distributed.hook import CompressionState, compression_hook
from fedcomp.distributed.outer import DiLoCo

__all__ = ["ByteCount", "CompressionError", "CompressionState", "DiLoCo", "allgather_bytes", "average",
           "compression_hook"]
