"""Downstream under partial participation: lagging clients get the missed payloads or a compressed
difference from the copy they hold (whichever is smaller), new clients build a seeded initial model
themselves, and every client's copy is what the server records for it, bit for bit."""

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from fedcomp.download.receiver import rebuild
from fedcomp.config import CodecConfig
from fedcomp.protocol.messages import MODEL_STATE_KEY
from fedcomp.download.seeded_init import lora_init
from fedcomp.statedict import to_record
from fedcomp.download.sender import Downstream

from tests.messages import make_ctx, make_msg

SHAPES = {"q.lora_A.weight": (4, 64), "q.lora_B.weight": (64, 4), "v.lora_A.weight": (4, 64),
          "v.lora_B.weight": (64, 4)}


def _flat(rec) -> np.ndarray:
    return np.concatenate([a.numpy().ravel() for a in rec.values()])


class Fed:
    """A server Downstream and the clients' contexts, driven round by round without training."""

    def __init__(self, compressor: str, nodes: int, init=None, **codec):
        self.ds = Downstream(CodecConfig.from_mapping(codec), compressor, init=init)
        self.ctx = {n: make_ctx(node_id=n) for n in range(nodes)}
        self.rnd = 0

    def round(self, weights: dict, nodes: list[int], reply: bool = True) -> dict:
        self.rnd += 1
        rec = to_record({k: torch.from_numpy(v) for k, v in weights.items()})
        msgs = [make_msg(RecordDict({"arrays": rec, "config": ConfigRecord({"server-round": self.rnd})}), dst=n)
                for n in nodes]
        self.ds.prepare(self.rnd, rec, msgs)
        out = {}
        for m, n in zip(msgs, nodes):
            out[n] = rebuild(m, self.ctx[n], "arrays", m.content["arrays"], dict(m.content["config"]))
            if reply:
                self.ds.received(n)
        return out


def _walk(seed=0, rounds=8):
    """A sequence of global adapters: seeded start, then random steps."""
    init = lora_init(SHAPES, seed=123)
    w = init.values(SHAPES)
    g = np.random.default_rng(seed)
    seq = [dict(w)]
    for _ in range(rounds - 1):
        w = {k: (v + 0.01 * g.standard_normal(v.shape)).astype(np.float32) for k, v in w.items()}
        seq.append(w)
    return init, seq


def test_new_client_builds_the_seeded_start_itself():
    init, seq = _walk()
    fed = Fed("sign", 2, init=init)
    got = fed.round(seq[0], [0, 1])
    assert fed.ds.sent_kind == {0: "init", 1: "init"}
    assert max(fed.ds.sent_bytes.values()) == 8 * len(SHAPES)  # one float64 bound per tensor, no values
    for rec in got.values():
        for k, v in seq[0].items():
            assert np.array_equal(rec[k].numpy(), v)  # bit for bit
    assert float(np.abs(got[0]["q.lora_A.weight"].numpy()).max()) <= 1 / 8  # 1/sqrt(fan_in = 64)
    assert not got[0]["q.lora_B.weight"].numpy().any()  # LoRA's B starts at zero


@pytest.mark.parametrize("codec", ["sign", "stc", "topk", "int8", "qsgd", "eden", "fp16"])
def test_lagging_client_gets_a_small_diff_and_holds_what_the_server_records(codec):
    init, seq = _walk(rounds=8)
    fed = Fed(codec, 3, init=init, density=0.05)
    dense = 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    fed.round(seq[0], [0, 1])
    for r in range(1, 6):  # node 1 misses rounds 2..6, node 2 is new at round 7
        fed.round(seq[r], [0])
    before = _flat(fed.ctx[1].state[MODEL_STATE_KEY])
    got = fed.round(seq[6], [0, 1, 2])
    assert fed.ds.sent_kind[0] == "payload"
    assert fed.ds.sent_kind[1] in ("diff", "chain") and fed.ds.sent_kind[2].startswith("init+")
    cap = dense / {"fp16": 1.9, "int8": 3.5, "qsgd": 5}.get(codec, 10)  # bits per entry of each codec
    assert fed.ds.sent_bytes[1] < cap and fed.ds.sent_bytes[2] < cap + 8 * len(SHAPES)
    target = np.concatenate([seq[6][k].ravel() for k in SHAPES])
    for n in (0, 1, 2):
        assert np.array_equal(_flat(got[n]), fed.ds.held(n))  # what the server records, bit for bit
    after = _flat(got[1])
    gap_before, gap_after = np.linalg.norm(target - before), np.linalg.norm(target - after)
    assert gap_after < gap_before  # the catch-up moved the copy towards the server's adapters
    if codec == "fp16":  # within the codec's bound: fp16 rounding of the difference
        assert np.abs(after - target).max() <= 2**-10 * np.abs(target - before).max() + 1e-7


def test_missed_payloads_travel_when_smaller_than_a_diff():
    init, seq = _walk(rounds=5)

    class FatDiffs(Downstream):  # per-node diffs in fp32: the chain of sign payloads is smaller
        def _codec(self, server_round, node=None, compressor=None, tensor=0):
            return (super()._codec(server_round, None, compressor, tensor) if node is None
                    else CodecConfig(compressor="none").build())

    fed = Fed("sign", 2)
    fed.ds = FatDiffs(CodecConfig(), "sign", init=init)
    fed.round(seq[0], [0, 1])
    for r in (1, 2):
        fed.round(seq[r], [0])
    got = fed.round(seq[3], [0, 1])
    assert fed.ds.sent_kind[1] == "chain"
    assert fed.ds.sent_bytes[1] == sum(len(fed.ds.nodes.payloads[u]) for u in (2, 3, 4))  # versions 2, 3, 4
    assert np.array_equal(_flat(got[1]), fed.ds.history[fed.ds.version])  # exactly B_v
    assert np.array_equal(_flat(got[0]), _flat(got[1]))


def test_a_client_that_did_not_reply_is_treated_as_new():
    init, seq = _walk(rounds=4)
    fed = Fed("stc", 2, init=init, density=0.1)
    fed.round(seq[0], [0, 1])
    fed.round(seq[1], [1], reply=False)  # node 1 got version 2 but its reply never came
    got = fed.round(seq[2], [1])  # no "holds version 2, payload applies to 1" error
    assert fed.ds.sent_kind[1].startswith("init")
    assert np.array_equal(_flat(got[1]), fed.ds.held(1))


def test_unknown_catchup_is_refused():
    with pytest.raises(ValueError, match="catch-up"):
        Downstream(CodecConfig(), "stc", catchup="dense")


def test_with_init_dense_new_clients_get_the_model_dense():
    init, seq = _walk(rounds=2)
    fed = Fed("sign", 2, init="dense")
    fed.round(seq[0], [0])
    got = fed.round(seq[1], [1])
    assert fed.ds.sent_kind[1] == "dense"
    assert np.array_equal(_flat(got[1]), fed.ds.history[fed.ds.version])


def test_without_a_seeded_start_new_clients_get_the_compressed_start_and_a_catch_up():
    """The default first contact: the one int8 start payload (B_1), then the cheaper of the chain of
    broadcast payloads and a per-node diff; the client holds what the server records, bit for bit."""
    init, seq = _walk(rounds=4)
    fed = Fed("sign", 2)
    got = fed.round(seq[0], [0])
    assert fed.ds.sent_kind[0] == "init" and np.array_equal(_flat(got[0]), fed.ds.history[1])
    start_bytes = fed.ds.sent_bytes[0]
    fed.round(seq[1], [0])
    fed.round(seq[2], [0])
    fed.round(seq[3], [0, 1])  # node 1 is new in round 4
    assert fed.ds.sent_kind[1] in ("init+chain", "init+diff")
    assert start_bytes < fed.ds.sent_bytes[1] < start_bytes + 3 * fed.ds.sent_bytes[0]
    assert np.array_equal(fed.ds.held(1), fed.ds.held(0)) == (fed.ds.sent_kind[1] == "init+chain")


def test_exact_catch_ups_keep_every_client_on_a_broadcast_version():
    init, seq = _walk(rounds=6)
    fed = Fed("stc", 3, init=init, density=0.05)
    fed.ds = Downstream(CodecConfig.from_mapping({"density": 0.05}), "stc", init=init, catchup="exact")
    fed.round(seq[0], [0, 1])
    for r in (1, 2, 3):
        fed.round(seq[r], [0])
    got = fed.round(seq[4], [0, 1, 2])  # node 1 lags 3 rounds, node 2 is new
    assert fed.ds.sent_kind[1] == "chain" and fed.ds.sent_kind[2] == "init+chain"
    for n in (0, 1, 2):
        assert np.array_equal(_flat(got[n]), fed.ds.history[fed.ds.version])  # exactly B_v, bit for bit


@pytest.mark.parametrize("codec,tol", [("fp16", 1e-3), ("stc", None)])
def test_server_memory_is_bounded_and_evicted_nodes_start_again(codec, tol):
    """Many new nodes over many rounds (unbounded, that would be one model copy per node ever seen and
    one payload per round): the stored copies stay within ``max_copies``, forgotten nodes are treated
    as new, and every client holds what the server records for it (fp16: within fp16 rounding of the
    global model)."""
    init, seq = _walk(rounds=40)
    fed = Fed(codec, 60, init=init, density=0.05)
    fed.ds.nodes.max_copies = 4.0
    rng = np.random.default_rng(1)
    kinds = set()
    for w in seq:
        nodes = sorted(rng.choice(60, 5, replace=False).tolist())
        got = fed.round(w, nodes)
        kinds |= set(fed.ds.sent_kind.values())
        assert fed.ds.nodes.copies() <= 4.0
        g = np.concatenate([w[k].ravel() for k in SHAPES])
        for n, rec in got.items():
            held = fed.ds.held(n)
            if held is not None:
                assert np.array_equal(_flat(rec), held)
            if tol is not None:
                assert np.abs(_flat(rec) - g).max() <= tol
    assert any(k.startswith("init+") for k in kinds)  # forgotten / new nodes after round 1 start from the seed
    assert len(fed.ds.nodes.versions) + len(fed.ds.nodes.private) <= 4


def test_max_copies_is_validated():
    with pytest.raises(ValueError, match="max_copies"):
        Downstream(CodecConfig(), "stc", max_copies=1)


def test_a_round_of_catch_ups_holds_no_model_copy_per_node():
    """One round sending 40 lagging nodes a per-node diff (partial participation): the server held, until
    the replies came, one model-sized float32 copy per node (what each would hold), so ``prepare``'s
    memory grew with the nodes sampled (about 100 model copies for 1000 nodes at 10 %, 4.5 GB at
    ResNet-18 size) whatever ``max_copies`` said. Now it keeps each node's diff bytes (already in its
    message) and rebuilds the copy when the node replies; memory stays a few model copies, the copies
    kept after the replies within ``max_copies``, and each node holds what the server records."""
    import gc
    import tracemalloc

    n_nodes, numel = 40, 200_000
    model_bytes = 4 * numel
    rng = np.random.default_rng(0)
    seq = [{"w": (0.05 * rng.standard_normal(numel)).astype(np.float32)}]
    for _ in range(3):
        seq.append({"w": (seq[-1]["w"] + 0.01 * rng.standard_normal(numel)).astype(np.float32)})
    fed = Fed("stc", n_nodes + 1, density=0.05)
    fed.round(seq[0], list(range(n_nodes)))  # every node starts from B_1 ...
    fed.round(seq[1], [n_nodes])
    fed.round(seq[2], [n_nodes])  # ... and lags three versions
    fed.rnd += 1
    rec = to_record({"w": torch.from_numpy(seq[3]["w"])})
    msgs = [make_msg(RecordDict({"arrays": rec, "config": ConfigRecord({"server-round": fed.rnd})}), dst=n)
            for n in range(n_nodes)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fed.ds.prepare(fed.rnd, rec, msgs)
        retained, peak = (m - before for m in tracemalloc.get_traced_memory())  # the messages included
    finally:
        tracemalloc.stop()
    assert set(fed.ds.sent_kind.values()) == {"diff"}  # cheaper than the chain of three payloads
    assert peak < 8 * model_bytes, peak / model_bytes  # before: 45.6x (one copy per node)
    assert retained < 6 * model_bytes, retained / model_bytes
    got = [rebuild(m, fed.ctx[n], "arrays", m.content["arrays"], dict(m.content["config"]))
           for n, m in enumerate(msgs)]
    for n in range(n_nodes):
        fed.ds.received(n)
    assert fed.ds.nodes.copies() <= fed.ds.nodes.copy_budget()
    kept = [n for n in range(n_nodes) if fed.ds.held(n) is not None]
    assert kept  # the latest repliers are remembered, the others forgotten (new next time)
    for n in kept:
        assert np.array_equal(got[n]["w"].numpy(), fed.ds.held(n))  # bit for bit


def _shared_and_private(shared, private: int, entries: int, stats=None):
    """NodeCopies (budget 10) where the ``shared`` nodes hold version 1 (each with the statistics copy
    ``stats``, if given), node ``private`` a private copy made from version 2, and version 3 is the latest."""
    from fedcomp.download.node_copies import Base, BaseKind, Diff, NodeCopies

    nodes = NodeCopies(max_copies=10)
    nodes.add_version(np.zeros(entries, np.float32))
    for node in shared:
        nodes.send(node, 1)
        if stats is not None:
            nodes.send_stats(node, stats)
        nodes.commit(node, rebuild=None)
    nodes.add_version(np.ones(entries, np.float32))
    nodes.send(private, 2, Diff(b"diff", Base(BaseKind.VERSION, 1)))
    nodes.commit(private, rebuild=lambda base, payload: base + 0.5)
    nodes.add_version(np.full(entries, 2.0, np.float32))
    nodes.drop_unheld()
    return nodes


def test_eviction_forgets_the_nodes_whose_forgetting_frees_memory_first():
    """Three nodes that replied long ago share version 1; a more recent node holds a private copy. One copy
    over the budget: before, the least recently replying went first, so all three holders of version 1
    were forgotten (the first two freed nothing) and would each start again from the first contact. Now
    the node whose forgetting alone frees a copy goes: one node forgotten, not three."""
    nodes = _shared_and_private((1, 2, 3), 4, 100)
    assert sorted(nodes.versions) == [1, 3] and list(nodes.private) == [4]
    assert nodes.copies() == 3  # B_1 (nodes 1-3), node 4's private copy, the latest B_3
    nodes.evict(2)
    assert sorted(nodes.node_version) == [1, 2, 3] and nodes.private == {}
    assert nodes.copies() == 2
    nodes.evict(1)  # nobody frees memory alone: the least recently replying go until B_1 does
    assert nodes.node_version == {} and list(nodes.versions) == [3] and nodes.copies() == 1


def test_eviction_drops_statistics_copies_before_forgetting_any_node():
    """Ten nodes share version 1, each with a small BatchNorm statistics copy; one more holds a private
    copy. One copy over the budget: before, every node with a statistics copy counted as one whose
    forgetting frees memory, so the ten were forgotten whole, least recently replying first. Now their
    statistics copies go alone (the nodes stay known), then the private copy's node: one node forgotten."""
    from fedcomp.statedict import FlatModel

    stats = FlatModel({"bn.running_mean": np.zeros(1, np.float32)}, {"bn.running_mean": "float32"})
    nodes = _shared_and_private(range(10), 10, 1000, stats)
    assert nodes.copies() == pytest.approx(3 + 10 * 4 / 4000)  # B_1, node 10's copy, B_3, 10 statistics copies
    nodes.evict(2)
    assert sorted(nodes.node_version) == list(range(10)) and nodes.stats == {} and nodes.private == {}
    assert nodes.copies() == 2


def test_a_node_still_to_reply_keeps_the_base_of_its_catch_up():
    """Committing one reply over the budget used to be able to forget the private copy another node's
    catch-up diff was relative to, before that node replied: the node then became unknown (a new first
    contact next time, and its update could not be counted from its copy). Pending nodes are not evicted."""
    from fedcomp.download.node_copies import Base, BaseKind, Diff, NodeCopies

    nodes = NodeCopies(max_copies=3)
    nodes.add_version(np.zeros(100, np.float32))
    for node in (1, 2):  # both hold private copies
        nodes.send(node, 1, Diff(b"d", Base(BaseKind.VERSION, 1)))
        nodes.commit(node, rebuild=lambda base, payload: base + 1.0)
    nodes.add_version(np.ones(100, np.float32))
    nodes.drop_unheld()
    # this round: node 1 gets a diff from its private copy, node 2 one from its own; node 2 replies first
    nodes.send(1, 2, Diff(b"d", Base(BaseKind.PRIVATE)))
    nodes.send(2, 2, Diff(b"d", Base(BaseKind.PRIVATE)))
    nodes.max_copies = 2.0
    nodes.commit(2, rebuild=lambda base, payload: base + 1.0)
    assert 1 in nodes.private  # node 1's base survives node 2's commit
    nodes.commit(1, rebuild=lambda base, payload: base + 1.0)
    assert 1 in nodes.node_version and np.array_equal(nodes.held(1), np.full(100, 2.0, np.float32))
    assert nodes.copies() <= 2.0
