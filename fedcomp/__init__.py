"""fedcomp: federated learning on Flower with compressed model updates.

The library (what an existing Flower app imports): ``fedcomp.compression`` (codecs, wire format,
error feedback; no Flower), ``fedcomp.client`` (``compression_mod``, ``CompressedNumPyClient``),
``fedcomp.strategies`` (``CompressedStrategy``, ``LegacyCompressedStrategy``), ``fedcomp.secagg``
(SecAgg+ mods and strategy), ``fedcomp.privacy``. The reference apps and launchers built on it:
``fedcomp.app``, ``fedcomp.run``; their task (data, models, training) in ``fedcomp.task``.
``docs/architecture.md`` draws the layers.
"""

__version__ = "0.1.0"
