"""fedcomp: federated learning on Flower with compressed model updates.

Subpackages: ``fedcomp.compression`` (codecs, wire format, error feedback; no Flower),
``fedcomp.client`` (``compression_mod``, ClientApp), ``fedcomp.strategies``
(``CompressedStrategy``), ``fedcomp.server`` (ServerApp, results).
"""

__version__ = "0.1.0"
