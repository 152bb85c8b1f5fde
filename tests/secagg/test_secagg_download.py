"""The compressed download on the SecAgg+ path: the model of Flower's legacy train messages rides the
same sender as CompressedStrategy's, every node trains from the copy the server records, and the
workflow counts every message of the four stages as Flower serialises it."""

import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from flwr.common.serde import recorddict_to_proto

from fedcomp.compression import PayloadError
from fedcomp.config import CodecConfig
from fedcomp.download.sender import Downstream
from fedcomp.protocol.messages import MODEL_VERSION, payload_array
from fedcomp.download.secagg import FIT_ARRAYS, FIT_CONFIG, SecAggDownload, legacy_model, named_model, receive_fit_model
from fedcomp.secagg.encoding import flower_weight, quantization_bound

from ..messages import make_msg
from .helpers import RecordingGrid, RoundCountingGrid, global_model, num_examples, run_rounds

N = 4


def _download(codec: str, **kw) -> SecAggDownload:
    sender = Downstream(CodecConfig.from_kwargs("stc", True), codec, init=kw.pop("init", "int8"), **kw)
    return SecAggDownload(sender, list(global_model()))


class WeighingGrid(RecordingGrid):
    """Adds up the serialised content of every message it carries (outside fedcomp's own count)."""

    down = up = 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.down += sum(recorddict_to_proto(m.content).ByteSize() for m in messages)
        out = list(super().send_and_receive(messages, timeout=timeout))
        self.up += sum(recorddict_to_proto(r.content).ByteSize() for r in out if not r.has_error())
        return out


def test_legacy_record_round_trip_keeps_order_values_and_dtypes():
    arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "h": np.array([1.5, -2], np.float16),
              "steps": np.array(7, np.int64), "mask": np.array([True, False])}
    rec = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    legacy = legacy_model(rec)
    assert list(legacy.keys()) == ["0", "1", "2", "3"] and {a.stype for a in legacy.values()} == {"numpy.ndarray"}
    back = named_model(legacy, list(arrays))
    assert list(back.keys()) == list(arrays)
    for k, v in arrays.items():
        got = back[k].numpy()
        assert got.dtype == v.dtype and got.shape == v.shape and np.array_equal(got, v)
    with pytest.raises(ValueError, match="3 named tensors, the train message carries 4"):
        named_model(legacy, ["w", "h", "steps"])


def test_a_dense_legacy_message_is_left_as_it_is():
    rec = legacy_model(ArrayRecord({"w": Array(np.ones(3, np.float32))}))
    msg = make_msg(RecordDict({FIT_ARRAYS: rec, FIT_CONFIG: ConfigRecord({"lr": 0.1})}))
    assert receive_fit_model(msg, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})) \
        is False
    assert msg.content[FIT_ARRAYS] is rec


def test_a_malformed_step_is_refused_before_the_app_sees_it():
    """Payloads under the version keys that do not decode: PayloadError (Flower's error reply: a dropped client)."""
    rec = ArrayRecord({"fedcomp.model": payload_array(b"\x00" * 9)})
    msg = make_msg(RecordDict({FIT_ARRAYS: rec, FIT_CONFIG: ConfigRecord({MODEL_VERSION: 2, "fedcomp-init-seed": 1})}))
    with pytest.raises(PayloadError):
        receive_fit_model(msg, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={}))


@pytest.mark.parametrize("codec", ["int8", "sign"])
def test_secagg_rounds_with_a_compressed_download(codec, caplog):
    """Each client adds a fixed delta to the copy it holds: the aggregate is the same as with the dense
    download (within SecAgg+'s quantization), every node's copy is the one the server records (the digests
    agree: nobody is re-synchronised), the model travels in far fewer bytes, and the workflow's count of
    every message both ways equals an outside count."""
    dense, _, wf_dense, grid_dense = run_rounds(3, N, 1.0, grid_cls=WeighingGrid)
    download = _download(codec)
    with caplog.at_level(logging.WARNING):
        models, strategy, workflow, grid = run_rounds(3, N, 1.0, download=download, grid_cls=WeighingGrid)
    assert not [r for r in caplog.records if "first contact next time" in r.getMessage()]
    # each run's SecAgg+ rounding (stochastic, OS entropy) moves each entry by at most the bound a round
    step = quantization_bound([flower_weight(num_examples(p), 1000.0, 1 << 16) for p in range(N)], 1.0, 1 << 16)
    for r in (1, 2, 3):
        bound = 2 * r * step + 1e-5
        assert strategy.history[r]["num-replies"] == N
        for k in ("w", "b"):
            assert np.abs(models[r][k].astype(np.float64) - dense[r][k]).max() <= bound
        assert models[r]["steps"] == 7
    nodes = download.downstream.nodes
    assert all(nodes.held(n) is not None for n in grid.contexts)  # every node's copy is known to the server
    sent = sum(download.sent_bytes.values())  # the last round's model, all nodes
    assert sent < (0.3 if codec == "int8" else 0.05) * N * 4 * 2050
    for g, wf in ((grid, workflow), (grid_dense, wf_dense)):
        counted = sum(v["wire-bytes-down"] + v["wire-bytes-up"] for v in wf.wire.rounds.values())
        assert counted == g.down + g.up
    fp32 = sum(v["wire-bytes-fp32"] for v in workflow.wire.rounds.values())
    assert fp32 == sum(v["wire-bytes-fp32"] for v in wf_dense.wire.rounds.values())
    assert grid.down < 0.5 * grid_dense.down


def test_a_node_that_missed_a_round_gets_a_first_contact_and_trains_on():
    """Partition 1 fails round 2's collect stage (after its copy may or may not have moved): the server
    forgets it, and round 3 brings it back with a first contact."""
    class MissOnce(RoundCountingGrid, WeighingGrid):
        def on_round(self, server_round):
            self.drop = {1} if server_round == 2 else set()

    download = _download("int8")
    models, strategy, _, _ = run_rounds(3, N, 1.0, download=download, grid_cls=MissOnce)
    assert [strategy.history[r]["num-replies"] for r in (1, 2, 3)] == [N, N - 1, N]
    assert np.isfinite(models[3]["w"]).all()


def test_the_download_refuses_a_correction():
    sender = Downstream(CodecConfig.from_kwargs("stc", True), "stc", correction=1.0)
    with pytest.raises(ValueError, match="masked sum"):
        SecAggDownload(sender)



def test_nodes_on_flowers_own_mod_get_the_model_dense():
    """A node that answered the setup without packing runs Flower's secaggplus_mod, not fedcomp: it could not
    read the compressed download, so it gets the model as it is; the others ride the download."""
    from flwr.client.mod import secaggplus_mod

    from fedcomp.secagg import shared_randomk_mod

    download = _download("int8")
    _, strategy, _, _ = run_rounds(2, N, 1.0, download=download, mods=(secaggplus_mod, shared_randomk_mod))
    assert [strategy.history[r]["num-replies"] for r in (1, 2)] == [N, N]
    assert download.sent_bytes == {}  # nobody was sent the compressed form


def test_nodes_on_the_last_version_get_the_rounds_secure_sum_not_the_model(caplog):
    """Shared random-k with rotation and SecAgg+'s 3-bit grid: from round 2 on the broadcast step is the
    last round's k summed values and its seed (`fedcomp.download.shared_step`), a few bits a value; every
    node rebuilds the server's global model from it to float32 rounding, and its digest agrees."""
    from fedcomp.download.receiver import MODEL_STATE_KEY
    from fedcomp.download.shared_step import MAGIC
    from fedcomp.statedict import FlatModel

    download = _download("int8", init="dense")  # the start exact: G - B is 0 when the sums begin
    steps, broadcast_step = [], download.downstream._broadcast_step

    def spy(*args):
        payload, after = broadcast_step(*args)
        steps.append(payload[:4] == MAGIC)
        return payload, after

    download.downstream._broadcast_step = spy
    with caplog.at_level(logging.WARNING):
        models, strategy, _, grid = run_rounds(4, N, 0.25, rotation=True, qbits=3, clipping_range=0.05,
                                               download=download, grid_cls=WeighingGrid)
    assert not [r for r in caplog.records if "first contact next time" in r.getMessage()]
    assert steps == [True] * 3  # rounds 2, 3, 4
    k = strategy.history[4]["k"]
    assert max(download.sent_bytes.values()) < k  # under a byte a value; int8 sends one a model entry
    def flat(m):
        return np.concatenate([np.asarray(m[k], np.float64).ravel() for k in ("w", "b")])

    for ctx in grid.contexts.values():  # each node holds the server's broadcast B bit for bit
        copy = FlatModel.from_record(ctx.state[MODEL_STATE_KEY])
        assert np.array_equal(flat(copy).astype(np.float32), download.downstream.broadcast)
        assert copy["steps"] == models[3]["steps"]
    # and B is the global model to float32 rounding
    assert np.abs(flat(models[3]) - download.downstream.broadcast).max() <= 1e-6 * np.abs(flat(models[3])).max()
