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
        cache: dict = {}
        for (_, ins), (_, plain_ins) in zip(instructions, plain):
            self.count.add(server_round, phase, "down", _bytes(_ins_content(ins), ins.parameters, cache),
                           _bytes(_ins_content(plain_ins), plain_ins.parameters, cache))

    def received(self, server_round: int, phase: str, results: list, model: Parameters | None) -> None:
        """Count ``results`` (``(proxy, FitRes or EvaluateRes)`` as they arrived, before anything leaves their
        metrics); ``model``: the dense model a plain app's train result carries."""
        cache: dict = {}
        for _, res in results:
            plain = {k: v for k, v in (res.metrics or {}).items() if k not in REPORT_KEYS and k != DIGEST_KEY}
            if isinstance(res, FitRes):
                dense = FitRes(res.status, model if model is not None else res.parameters, res.num_examples, plain)
            else:
                dense = type(res)(res.status, res.loss, res.num_examples, plain)
            params = getattr(res, "parameters", None)
            self.count.add(server_round, phase, "up", _bytes(_res_content(res), params, cache),
                           _bytes(_res_content(dense), getattr(dense, "parameters", None), cache))


def _bytes(content: RecordDict, parameters: Parameters | None, cache: dict) -> int:
    """Serialised size of ``content``; its model record (``*.parameters``, made from ``parameters``) weighed once
    per ``Parameters`` object through ``cache`` (instructions and plain results share one model: weighing it
    for every client would copy the model once a client). Records serialise independently, so the sum is exact."""
    total = 0
    for key, record in content.items():
        if parameters is not None and key.endswith(".parameters"):
            if (key, id(parameters)) not in cache:
                cache[key, id(parameters)] = content_bytes(RecordDict({key: record}))
            total += cache[key, id(parameters)]
        else:
            total += content_bytes(RecordDict({key: record}))
    return total


__all__ = ["LegacyWire"]
