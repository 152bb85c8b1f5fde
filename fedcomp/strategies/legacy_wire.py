"""What a legacy-API round costs on the wire: each instruction and result as Flower's compatibility layer
serialises it (``flwr.compat``: the records a ``GridClientProxy`` sends and receives, train and evaluate),
and the same for a plain app (the inner strategy's instructions as it made them, results with the model
dense and without fedcomp's report keys). Figures as `fedcomp.strategies.wire_bytes`' (``wire-bytes-*``)."""

from __future__ import annotations

from flwr.app import RecordDict
from flwr.common import EvaluateIns, FitIns, FitRes, Parameters
from flwr.compat.common import recorddict_compat as compat

from fedcomp.download.legacy import DIGEST_KEY
from fedcomp.protocol.messages import REPORT_KEYS
from fedcomp.strategies.wire_bytes import WireCount, content_bytes


def _ins_content(ins) -> RecordDict:
    if isinstance(ins, FitIns):
        return compat.fitins_to_recorddict(ins, keep_input=True)
    return compat.evaluateins_to_recorddict(ins, keep_input=True)


def _res_content(res) -> RecordDict:
    if isinstance(res, FitRes):
        return compat.fitres_to_recorddict(res, keep_input=True)
    return compat.evaluateres_to_recorddict(res)


class LegacyWire:
    """The serialised bytes of a legacy strategy's instructions and results, per round and phase (``count``:
    a `WireCount`)."""

    def __init__(self) -> None:
        self.count = WireCount()

    def sent(self, server_round: int, phase: str, instructions: list, plain: list) -> None:
        """Count ``instructions`` (``(proxy, FitIns or EvaluateIns)`` as sent); ``plain``: the same clients'
        instructions as the inner strategy made them (what a plain app sends)."""
        cache: dict[int, int] = {}  # the inner strategy's instructions share one Parameters: serialise it once
        for (_, ins), (_, plain_ins) in zip(instructions, plain):
            key = id(plain_ins)
            if key not in cache:
                cache[key] = content_bytes(_ins_content(plain_ins))
            self.count.add(server_round, phase, "down", content_bytes(_ins_content(ins)), cache[key])

    def received(self, server_round: int, phase: str, results: list, model: Parameters | None) -> None:
        """Count ``results`` (``(proxy, FitRes or EvaluateRes)`` as they arrived, before anything leaves their
        metrics); ``model``: the dense model a plain app's train result carries."""
        for _, res in results:
            plain = {k: v for k, v in (res.metrics or {}).items() if k not in REPORT_KEYS and k != DIGEST_KEY}
            if isinstance(res, FitRes):
                dense = FitRes(res.status, model if model is not None else res.parameters, res.num_examples, plain)
            else:
                dense = type(res)(res.status, res.loss, res.num_examples, plain)
            self.count.add(server_round, phase, "up", content_bytes(_res_content(res)),
                           content_bytes(_res_content(dense)))


__all__ = ["LegacyWire"]
