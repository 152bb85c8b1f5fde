"""Compressed updates under Flower's SecAgg+: shared-seed random-k (and rotation) inside the masks.

Client: ``ClientApp(mods=[packing_secaggplus_mod, shared_randomk_mod])`` (fedcomp's own app:
``secagg_mod`` before ``compression_mod``). Server: ``DefaultWorkflow(fit_workflow=
CompressedSecAggPlusWorkflow(...))`` with ``SharedRandomKStrategy(FedAvg(...), density)`` in the
``LegacyContext``. Masking, key agreement, secret sharing and dropout recovery are Flower's.
"""

from fedcomp.config.secagg import SECAGG_CODECS, SecAggConfig, check_codec_under_secagg
from fedcomp.secagg.client import packing_secaggplus_mod, secagg_mod, shared_randomk_mod
from fedcomp.secagg.encoding import SharedProjection
from fedcomp.secagg.strategy import SharedRandomKStrategy
from fedcomp.secagg.workflow import CompressedSecAggPlusWorkflow, SecAggHalted

__all__ = [
           "SECAGG_CODECS",
           "CompressedSecAggPlusWorkflow", "SecAggHalted",
           "SecAggConfig",
           "SharedProjection",
           "SharedRandomKStrategy",
           "check_codec_under_secagg",
           "packing_secaggplus_mod",
           "secagg_mod",
           "shared_randomk_mod",
]
