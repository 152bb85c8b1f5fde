"""The compressed download on the SecAgg+ path.

SecAgg+ hides each client's update from the server; the global model is no secret from the nodes
that train it, so it can travel as `fedcomp.strategies.CompressedStrategy`'s download does. Flower
1.42 runs SecAgg+ in its legacy ``DefaultWorkflow``, whose train messages carry the model as the
legacy record ``fitins.parameters`` (one ``np.save`` blob per tensor, under ``"0"``, ``"1"``, ... in
model order) and the train config as ``fitins.config``, beside SecAgg+'s own record:

- server: `SecAggDownload` rewrites the model of each train message into the form the sender
  (`fedcomp.download.sender.Downstream`) picks for its node (a step on the copy the node holds, a
  first contact, nothing new when it holds the latest broadcast) and notes, from the replies, what
  each node holds now (the digest of its copy, `fedcomp.download.receiver.report_copy`);
- client: `receive_fit_model` (called by `fedcomp.secagg.client.secagg_mod` before SecAgg+ and the
  app see the message) rebuilds the model from this node's copy (`fedcomp.download.receiver.rebuild`:
  every check of the Message-API download) and writes it back in the legacy form.

A node updates against the copy it trained from, as under `CompressedStrategy`; what a compressed step
leaves out of the global model stays in the server's error feedback (``G - B``) for the next step.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.common import Parameters, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat

from fedcomp.download.receiver import rebuild, report_copy
from fedcomp.download.sender import Downstream, reported_copy
from fedcomp.download.shared_step import SharedStep
from fedcomp.protocol.messages import MODEL_VERSION

#: The legacy workflow's records of a train message: the model and the train config.
FIT_ARRAYS, FIT_CONFIG = "fitins.parameters", "fitins.config"


def named_model(rec: ArrayRecord, names: list[str]) -> ArrayRecord:
    """A legacy model record (``"0"``, ``"1"``, ... ``np.save`` blobs, read without pickle) as an
    ArrayRecord under the model's ``names``, in the same order.

    Raises
    ------
    ValueError
        ``names`` and the record hold different numbers of tensors.
    """
    arrays = parameters_to_ndarrays(compat.arrayrecord_to_parameters(rec, keep_input=True))
    if len(arrays) != len(names):
        raise ValueError(f"the model has {len(names)} named tensors, the train message carries {len(arrays)}")
    return ArrayRecord({n: Array(np.require(a, requirements='C')) for n, a in zip(names, arrays)})  # 0-d stays 0-d


def legacy_model(rec: ArrayRecord) -> ArrayRecord:
    """A record of dense tensors as the legacy workflow carries a model: ``np.save`` blobs under ``"0"``,
    ``"1"``, ... in ``rec``'s order (what ``flwr.compat`` makes of ``FitIns.parameters``)."""
    params = ndarrays_to_parameters([a.numpy() for a in rec.values()])
    return compat.parameters_to_arrayrecord(params, keep_input=True)


class SecAggDownload:
    """The server side of the SecAgg+ path's compressed download (see the module docstring).

    Parameters
    ----------
    downstream : Downstream
        The sender (codec, first contact, what each node holds); its ``correction`` must be 0: the
        server never sees a client's update under SecAgg+, only the masked sum.
    names : list of str, optional
        The model's tensor names in order (BatchNorm statistics and tied names are found by name);
        default ``"0"``, ``"1"``, ...

    Raises
    ------
    ValueError
        A ``downstream`` with a correction, or with ``batchnorm_stats = "codec"`` (the secure aggregate
        clamps running variances at 0; a compressed step of them would go below 0 on the nodes).
    """

    def __init__(self, downstream: Downstream, names: list[str] | None = None) -> None:
        if downstream.correction:
            raise ValueError("the downstream correction needs each client's update; under SecAgg+ the server sees "
                             "only the masked sum (use correction 0)")
        if downstream.codec.batchnorm_stats == "codec":
            raise ValueError("batchnorm-stats = 'codec' under SecAgg+: the secure aggregate clamps BatchNorm running "
                             "variances at 0, and a compressed step of them lands below 0, which nodes refuse (use "
                             "'auto' or 'small')")
        self.downstream, self.names = downstream, names
        self._pending: set[int] = set()  # nodes sent a train message in the current exchange
        #: of the last round: the model's bytes sent to each node (payloads and exact tensors)
        self.sent_bytes: dict[int, int] = {}

    def _names(self, n: int) -> list[str]:
        return list(self.names) if self.names is not None else [str(i) for i in range(n)]

    def start(self, parameters: Parameters) -> Parameters:
        """The initial model as new nodes will build it (`Downstream.start_model`: seeded where the
        first-contact policy says); give it to the inner strategy as its initial parameters."""
        arrays = parameters_to_ndarrays(parameters)
        names = self._names(len(arrays))
        rec = self.downstream.start_model(ArrayRecord({n: Array(a) for n, a in zip(names, arrays)}))
        return ndarrays_to_parameters([rec[n].numpy() for n in names])

    def on_send(self, server_round: int, messages: list[Message], dense_nodes: set[int] = frozenset(),
                step: SharedStep | None = None) -> ArrayRecord | None:
        """Rewrite the model of the train messages among ``messages`` (those with ``fitins.parameters``),
        except those to ``dense_nodes`` (nodes that do not run fedcomp, which get the model as it is);
        returns their dense model record as it was (None: no train message). ``step``: the last applied
        round's update as its shared-projection sum (`fedcomp.secagg.SharedRandomKStrategy.last_step`):
        nodes that hold the previous version get that sum instead of the codec's step when it describes
        the new model (`fedcomp.download.shared_step`).

        Raises
        ------
        ValueError
            Train messages that carry different models (the download sends one global model a round).
        """
        fits = [m for m in messages if FIT_ARRAYS in m.content.array_records]
        if not fits:
            return None
        dense = fits[0].content[FIT_ARRAYS]
        blobs = [a.data for a in dense.values()]
        if any([a.data for a in m.content[FIT_ARRAYS].values()] != blobs for m in fits[1:]):
            raise ValueError("the compressed download sends one global model a round, but the strategy's train "
                             "messages carry different models")
        target = named_model(dense, self._names(len(blobs)))
        fits = [m for m in fits if m.metadata.dst_node_id not in dense_nodes]
        if not fits:
            return dense
        self.downstream.prepare(server_round, target, fits, records=(FIT_ARRAYS, FIT_CONFIG), step=step)
        self.sent_bytes = dict(self.downstream.sent_bytes)
        self._pending = {m.metadata.dst_node_id for m in fits}
        return dense

    def on_replies(self, replies: list[Message]) -> None:
        """Each node that answered its train message holds what it was sent if the digest it reports
        says so; a node that answered with an error, or without a digest, is forgotten (a first contact
        next time): it may hold the new copy or the old one."""
        answered = [r for r in replies if r.metadata.src_node_id in self._pending]
        if not answered:
            return
        digests = {r.metadata.src_node_id: (b"" if r.has_error() else reported_copy(r) or b"") for r in answered}
        self.downstream.note_replies([{"node": n} for n in sorted(digests)], digests=digests)
        self._pending -= set(digests)

    def resynced(self) -> list[int]:
        """The nodes forgotten since the last call (their copy differed from the server's record, or
        they answered with an error): logged by the caller."""
        out = list(self.downstream.resynced)
        self.downstream.resynced.clear()
        return out


def receive_fit_model(msg: Message, context: Context) -> bool:
    """Client side: rebuild the model of a legacy train message sent by `SecAggDownload` (its
    ``fitins.config`` carries ``fedcomp-model-version``) from this node's copy, in place, as the legacy
    record the workflow expects. Returns whether the message was one (False: dense, left as it is).

    Raises
    ------
    PayloadError, CompositionError
        As `fedcomp.download.receiver.rebuild`: a malformed or hostile download, a version that is not
        newer than the held copy, a base this node does not hold; the held copy is kept.
    """
    content = msg.content
    if FIT_ARRAYS not in content.array_records or FIT_CONFIG not in content.config_records:
        return False
    cfg = content[FIT_CONFIG]
    if MODEL_VERSION not in cfg:
        return False
    content[FIT_ARRAYS] = legacy_model(rebuild(msg, context, FIT_ARRAYS, content[FIT_ARRAYS], cfg))
    return True


__all__ = ["FIT_ARRAYS", "FIT_CONFIG", "SecAggDownload", "legacy_model", "named_model", "receive_fit_model",
           "report_copy"]
