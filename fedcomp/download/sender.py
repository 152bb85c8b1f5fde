"""Server-to-client compression: the server broadcasts the change of the global model compressed,
with error feedback, and sends clients that missed rounds a small catch-up instead of the model.

Source: Sattler et al., IEEE TNNLS 2019 (STC in both directions, residuals on both sides); for
partial participation, the same paper's "caching" discussion (a client that missed rounds gets the
accumulated change).

What travels, per message (self-describing; `fedcomp.download.receiver` rebuilds it):

- **Compressed part**: every float tensor except BatchNorm's running statistics (unless
  ``batchnorm-stats = "codec"``) is one flat float32 vector in model order.
- **Exempt part**: integer/bool tensors travel as exact payloads in every message; BatchNorm
  ``running_mean``/``running_var`` too with ``batchnorm-stats = "small"``, so every client's copy
  of them *is* the global model's. With ``"auto"`` (the default) the server keeps each node's copy
  of the statistics (one vector of them per node, kept while the node is) and sends a node that
  holds one the change ``G - H`` of each statistic as a ``sign`` payload (1 bit per entry and one
  scale; key `fedcomp.download.layout.stat_delta_key`); node and server both apply it
  with `fedcomp.download.layout.apply_stat_delta` (a running variance kept at >= half its
  previous value), so
  the node's copy is known bit for bit and what was not sent stays in ``G - H`` (per-node error
  feedback). A node without a known copy gets them exactly (fp32, or dense/init forms). A client
  of an older fedcomp refuses the message (unknown keys): ``"small"`` serves it.

The server keeps the *broadcast model* B_v (version v) and the true global G. Each round it sends
``C(G - B_{v-1})`` and sets ``B_v = B_{v-1} + decompress(...)`` (server-side error feedback: what
was not sent stays in ``G - B``). Per destination node, the cheapest message its copy allows
(`fedcomp.download.plan`): the round's payload, a chain of missed payloads, a per-node diff
``C(G - H)`` (the node then holds ``H + decompress(...)``, which the server records, so the next
catch-up sends what this one missed: per-node error feedback), a first contact, or the model dense. A
first contact builds B_1 from a *seeded start* (`fedcomp.download.seeded_init`: LoRA's B = 0 and
seeded A; or every tensor of a model trained from scratch drawn like its initialisation: the seed and
one rule per tensor, a few bytes) or a *compressed start* (the initial model compressed from zero with
the first-contact codec, ``int8`` by default: 4x fewer bytes than fp32; the same start payload for
every node, so that later nodes catch up along the same broadcast versions and error feedback carries
what the start left out, ``G - B``).

A node counts as holding what it was sent only once its reply arrives (`Downstream.received`);
a node that was sent something and did not reply is treated as new next time (its copy is unknown).

Server memory: B and G, and what `node_copies.NodeCopies` keeps for catch-ups (the versions
and per-node copies nodes hold, the payloads of chains) within its copy budget; a forgotten node is
treated as new (seeded ``init`` + catch-up, or ``dense``), as after a missed reply.
"""

from __future__ import annotations

import hashlib
import struct
from logging import WARNING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log

from fedcomp.compression import CODECS, decompress, encode_exact, get_compressor
from fedcomp.config import CodecConfig
from fedcomp.config.codec import BATCHNORM_STATS_CODEC
from fedcomp.download.correction import check_correction, correct_for_copies
from fedcomp.download.first_contact import INIT_POLICIES, START_CODEC, check_init_policy, starting_model
from fedcomp.download.layout import (
    COPY_DIGEST_BYTES,
    apply_stat_delta,
    chain_key,
    decode_step,
    digest_segments,
    encode_per_tensor,
    gather,
    is_batchnorm_stat,
    is_running_var,
    round_to_dtypes,
    scatter,
    segments,
    stat_delta_key,
)
from fedcomp.download.node_copies import Base, BaseKind, NodeCopies
from fedcomp.download.options import Download, check_catchup, check_density, check_max_copies
from fedcomp.download.plan import PlanKind, plan_message
from fedcomp.download.seeded_init import INIT_SEED, INIT_STYPE, SeededInit
from fedcomp.download.shared_step import SHARED_STEP_TOLERANCE, SharedStep
from fedcomp.protocol.messages import BASE_VERSION, COPY_RECORD, MODEL_VERSION, payload_array
from fedcomp.statedict import FlatModel


def _model_digest(model: FlatModel) -> bytes:
    """A 32-byte digest of every tensor of ``model`` (BLAKE2b of the float vector and the exact tensors):
    whether the global model changed since the last broadcast step, without keeping a copy of it."""
    h = hashlib.blake2b(np.ascontiguousarray(model.flat), digest_size=32)  # the buffer itself: no model-sized copy
    for k in model.exact_keys:
        h.update(np.ascontiguousarray(model.exact[k]).reshape(-1).view(np.uint8))
    return h.digest()


def reported_copy(reply: Message) -> bytes | None:
    """The digest of the model copy a reply says its node holds (``fedcomp.copy``'s ``"digest"``,
    `fedcomp.download.receiver.report_copy`); None when the reply carries none (an older
    fedcomp on the node) or something that is not a digest."""
    rec = reply.content.config_records.get(COPY_RECORD)
    digest = None if rec is None else rec.get("digest")
    return digest if isinstance(digest, bytes) and len(digest) == COPY_DIGEST_BYTES else None


#: Why a reply to a versioned download without its copy's digest is refused.
NO_COPY_REPORT = (f"its reply carries no valid digest of its model copy (ConfigRecord '{COPY_RECORD}', 'digest': "
                  f"{COPY_DIGEST_BYTES} bytes): the node runs an older fedcomp (upgrade fedcomp on that node) or "
                  "sent a malformed one")


#: Added to the round in the codec seeds of an evaluate message's step, so that a seeded codec
#: (random-k) draws other positions than the train step of the same round.
EVALUATE_SEED_OFFSET = 2**31 - 1


class Downstream:
    """Per-run state of downstream compression.

    Parameters
    ----------
    codec : CodecConfig
        Parameters (density, levels, ...) for the downstream codec; ``batchnorm_stats`` says whether
        BatchNorm statistics travel as per-node sign changes ("auto", the default), exactly ("small")
        or with the compressed part ("codec").
    compressor : str
        Downstream codec name ("fp16", "stc", "sign", ...).
    seed : int
        Seed of stochastic codecs (mixed with the round and the node).
    init : SeededInit or str
        How a node that holds nothing gets its first model. A `SeededInit`: clients build the
        initial model from the seed (LoRA: B = 0, A from a seed), used only if the first round's
        global model equals it bit for bit (else a warning and a compressed start). ``"auto"``
        (default): LoRA adapters at peft's initialisation (every key a ``lora_`` tensor, ``lora_B``
        zero, ``lora_A`` within ``+-1/sqrt(fan_in)``) get a seeded start drawn the same way
        (`start_model` replaces ``lora_A`` by the seed's draw), any other model a compressed
        start with ``int8``. ``"seeded"``: every float tensor replaced by a seeded draw with its
        mean and variance (`fedcomp.download.seeded_init.seeded_like`; models trained from
        scratch only). A codec name: a compressed start with that codec. ``"dense"``: the model dense.
    density : float, optional
        Density of a sparse downstream codec (default: the codec config's ``density``).
    catchup : {"smallest", "exact"}
        Lagging clients get the smaller of the missed payloads and a per-client compressed diff
        ("smallest", default), or the missed payloads whenever the server still has them ("exact").
    max_copies : float or None
        Most model copies (float32 vectors of the compressed part) kept for nodes: stored versions,
        per-node catch-up copies and broadcast payloads (their bytes / the vector's bytes) together,
        besides B and G; at least 2 (this version and the previous one). Past it nodes are forgotten
        (`node_copies.NodeCopies.evict`), and a forgotten node restarts from the first contact
        (a per-node error-feedback copy lost). None (default,
        `node_copies.NodeCopies.copy_budget`): 8, or as many as
        `node_copies.COPY_BYTES_FLOOR` (256 MiB) holds when that is more, so that a small model (LoRA
        adapters, a small CNN) keeps a copy for every node of a cross-silo federation; the server's
        memory stays bounded whatever the number of nodes.
    correction : float
        ``c`` in [0, 1] of `fedcomp.download.correction`: each update is folded as ``delta_i - c (G - H_i)``,
        counted from the global model rather than the copy ``H_i`` its client trained from. Default 0.

    Raises
    ------
    ValueError
        ``catchup`` not one of the two, ``max_copies`` < 2 (or not a finite number or None), ``init`` not a
        policy or codec name, ``density`` outside (0, 1], ``correction`` not in [0, 1], or a ``compressor``
        with which the download's error feedback would diverge
        (`fedcomp.compression.Compressor.error_feedback_refusal`: ATOMO, QSGD with few levels).
    """

    def __init__(self, codec: CodecConfig, compressor: str, seed: int = 0, init: SeededInit | str | None = "auto",
                 catchup: str = "smallest", max_copies: float | None = None, density: float | None = None,
                 correction: float = 0.0) -> None:
        init = check_init_policy("auto" if init is None else init)
        #: c of `fedcomp.download.correction`: each update folded as ``delta_i - c (G - H_i)``
        self.correction = check_correction(correction)
        self.density = check_density(density)
        check_catchup(catchup)
        check_max_copies(max_copies)
        if compressor in CODECS and (refusal := codec.build(seed=0, compressor=compressor).error_feedback_refusal()):
            raise ValueError(f"downstream codec {compressor!r}: {refusal}. The download keeps what it did not send "
                             f"for the next round, as error feedback does: choose another downstream codec")
        self.codec, self.compressor, self.seed, self.init = codec, compressor, seed, init
        self.model: FlatModel | None = None  # B_v: every tensor
        #: "exact": lagging clients get the chain of missed payloads whenever it exists, never a per-client
        #: diff, so every client trains from a broadcast version exactly (a per-client diff through a sparse
        #: codec such as STC drifts from the broadcast under partial participation; the chain does not)
        self.exact_catchup = catchup == "exact"
        #: what each node holds and the server's memory for it; with "exact", B_1 and the payloads after
        #: it are kept for nodes not seen yet until the budget has no node left to forget
        self.nodes = NodeCopies(None if max_copies is None else float(max_copies), pin_start=self.exact_catchup)
        self._start: list[bytes] = []  # the compressed start's payload (empty: seeded start)
        self._start_init: SeededInit | None = None  # the rules of a new node's base (seeded, or zeros)
        #: this round: node -> bytes sent / the form of its message
        self.sent_bytes: dict[int, int] = {}
        self.sent_kind: dict[int, PlanKind] = {}
        #: this round's diffs from a shared base (`_diff`), emptied by `prepare`
        self._round_diffs: dict[Base, bytes] = {}
        #: the digest of the global model G that B_v was made for (`_model_digest`; None: none yet)
        self._target_digest: bytes | None = None
        #: nodes forgotten because the copy they reported differs from the server's record (`received`),
        #: since the caller last emptied it
        self.resynced: list[int] = []

    @property
    def version(self) -> int:
        """The latest broadcast version v (0 before the first round)."""
        return self.nodes.version

    @classmethod
    def for_run(cls, codec: CodecConfig, download: Download) -> Downstream | None:
        """The sender of ``download`` (None for a dense download: ``download.codec`` "none")."""
        if not download.compressed:
            return None
        return cls(codec, download.codec, init=download.init, catchup=download.catchup,
                   max_copies=download.max_copies, density=download.density, correction=download.correction)

    @property
    def history(self) -> dict[int, np.ndarray]:
        """``{version: B}``: this version's broadcast model, every float tensor flat in model order (a
        copy; empty before the first round). Not kept per round: the server holds no model copy for it."""
        return {} if self.model is None else {self.version: self.model.flat.copy()}

    @property
    def broadcast(self) -> np.ndarray | None:
        """B's float tensors, flat float32 (None before the first round)."""
        return None if self.model is None else self.model.flat

    # -- the compressed part -------------------------------------------------------------
    def _setup(self, target: FlatModel) -> None:
        exempt = self.codec.batchnorm_stats != "codec"
        self.exempt_keys = [k for k in target.float_keys if exempt and is_batchnorm_stat(k)]
        self.stat_deltas = bool(self.exempt_keys) and self.codec.batchnorm_stats == "auto"
        self.lossy_keys = [k for k in target.float_keys if k not in self.exempt_keys]
        self.sizes = [target.specs[k].numel for k in self.lossy_keys]
        self.num_lossy = sum(self.sizes)

    def _lossy(self, model: FlatModel) -> np.ndarray:
        """The compressed part of ``model`` (a float32 copy)."""
        return gather(model, self.lossy_keys)

    def _round_to_dtypes(self, vec: np.ndarray) -> np.ndarray:
        """Round a compressed-part vector to the tensors' dtypes (fp16/bf16), as the client's copy is."""
        return round_to_dtypes(self.model, self.lossy_keys, vec)

    def _decode(self, payload: bytes) -> np.ndarray:
        return decode_step(payload, self.sizes, sum(self.model.specs[k].numel for k in self.model.float_keys))

    def per_tensor(self) -> bool:
        """Whether a downstream step sends one payload per tensor (`encode_per_tensor`):
        ``selection = "tensor"``; under ``"auto"`` (default) only for a codec with one magnitude per
        payload (``sign``: per-tensor scales downward kept more of fp32's gain on the LoRA benchmark
        than one scale, ``docs/benchmarks/llm.md``; int8, EDEN and QSGD scale per block, STC and top-k
        pick their entries over the whole model); and only with more than one tensor to send."""
        name = self.compressor
        per = self.codec.selection == "tensor" or (self.codec.selection == "auto" and CODECS[name].one_scale)
        return per and sum(1 for n in self.sizes if n) > 1

    def _compress(self, vec: np.ndarray, server_round: int, node: int | None = None,
                  compressor: str | None = None) -> bytes:
        """One compressed step of the compressed part ``vec`` (float32, ``(num_lossy,)``): one payload of
        the whole vector, or one per tensor (`per_tensor`; not the first-contact ``compressor``,
        block-wise int8 by default), each tensor its own codec seed."""
        if compressor is not None or not self.per_tensor():
            return self._codec(server_round, node, compressor).compress(torch.from_numpy(vec))
        return encode_per_tensor(lambda i, part: self._codec(server_round, node, compressor, i).compress(
            torch.from_numpy(part)), vec, self.sizes)

    def _codec(self, server_round: int, node: int | None = None, compressor: str | None = None, tensor: int = 0):
        extra = 0 if node is None else int.from_bytes(hashlib.sha256(str(node).encode()).digest()[:4], "little")
        return self.codec.build(seed=self.seed + server_round + extra + 1_000_003 * tensor,
                                compressor=compressor or self.compressor, density=self.density)

    # -- the first model ----------------------------------------------------------------------
    def start_model(self, arrays: ArrayRecord) -> ArrayRecord:
        """The initial global model, seeded where the ``init`` policy says (called once, by
        `CompressedStrategy.start` before round 0's evaluation): `first_contact.starting_model`.

        Returns
        -------
        ArrayRecord
            ``arrays`` itself when nothing is seeded, else a new record.
        """
        arrays, self.init = starting_model(self.init, arrays)
        return arrays

    # -- one round --------------------------------------------------------------------------
    def prepare(self, server_round: int, arrays: ArrayRecord, messages: list[Message],
                phase: str = "train", records: tuple[str, str] | None = None,
                step: SharedStep | None = None) -> list[Message]:
        """Advance B to this round's global model and rewrite each message's arrays and config
        (`prepare_nodes`, each message's destination node its node).

        Every message gets its own RecordDict and ArrayRecord (as the real transport gives each
        node its own copy), so a handler that edits its input affects no other client.
        ``records``: the keys of the model's ArrayRecord and of the config in each message (default: the
        message's first ArrayRecord and first ConfigRecord, ``"config"`` if it has none; Flower's legacy
        workflows carry them as ``fitins.parameters`` and ``fitins.config`` beside SecAgg+'s own record).

        ``step``: the last round's update as its shared-projection sum (`prepare_nodes`).

        Returns the messages (modified in place) with a per-message ConfigRecord carrying the version
        keys (and the init seed for ``init`` messages).
        """
        keys = []
        for msg in messages:
            # Flower's strategies may share one RecordDict between messages: give each its own.
            msg.content = RecordDict(dict(msg.content.items()))
            keys.append(records or (next(iter(msg.content.array_records)),
                                    next(iter(msg.content.config_records), "config")))
        configs = [dict(m.content[c]) if c in m.content else {} for m, (_, c) in zip(messages, keys)]
        forms = self.prepare_nodes(server_round, arrays, [m.metadata.dst_node_id for m in messages], configs, phase,
                                   step)
        for msg, (arr_key, cfg_key), (rec, cfg) in zip(messages, keys, forms):
            msg.content[arr_key] = rec
            msg.content[cfg_key] = ConfigRecord(cfg)
        return messages

    def prepare_nodes(self, server_round: int, arrays: ArrayRecord, nodes: list, configs: list[dict],
                      phase: str = "train", step: SharedStep | None = None) -> list[tuple[ArrayRecord, dict]]:
        """Advance B to this round's global model ``arrays`` and return, for each of ``nodes`` (with its
        message's config), the model record in the form planned for it and its config with the version keys
        (and the init seed for first contacts).

        Train and evaluate messages go the same way (``phase``). B advances once per global model: the
        first call with a new G (federated evaluation after a round, or the next round's training) sends
        the step towards it, and a later call with the same G (the next round's train messages after
        evaluation) sends no new step: a node that holds B_v gets nothing but the config, one that
        does not the step or catch-up to B_v. A node evaluates the model it will train from, and what
        the step left out stays in ``G - B`` for the next round (server-side error feedback).
        ``phase = "evaluate"`` only changes the seeds of seeded codecs (`EVALUATE_SEED_OFFSET`).

        ``step``: the update that made this global model, as a secure round's shared-projection sum
        (`fedcomp.download.shared_step`); the broadcast step is that sum instead of the codec's when it
        lands within `fedcomp.download.shared_step.SHARED_STEP_TOLERANCE` of the global model.
        """
        if phase not in ("train", "evaluate"):
            raise ValueError(f"phase must be 'train' or 'evaluate', got {phase!r}")
        if phase == "evaluate":
            server_round += EVALUATE_SEED_OFFSET
        target = FlatModel.from_record(arrays)
        self.nodes.start_round()
        self._round_diffs = {}
        payload = None
        if self.model is None:
            self._setup(target)
            self.model = target
            self.nodes.add_version(self._lossy(target))
            self.nodes.set_start(self._check_init(target))
            if self.nodes.start is None and self.init != "dense":
                self._compressed_start(server_round, target)
        elif self._target_digest == _model_digest(target):  # G unchanged since B_v was made: no new step
            payload = self.nodes.payloads.get(self.version)
        else:
            b = self.nodes.versions[self.version]
            payload, b = self._broadcast_step(target, b, server_round, step)
            self.nodes.add_version(b, payload)
            scatter(self.model, self.lossy_keys, b)
            for k in self.exempt_keys:
                self.model.float_view(k)[...] = target.float_view(k)
            self.model.exact = target.exact
        self._target_digest = _model_digest(target)
        g = self._lossy(target)
        extras = {k: payload_array(get_compressor("none").compress(torch.from_numpy(self.model.float_view(k).copy())))
                  for k in self.exempt_keys}
        extras.update({k: payload_array(encode_exact(v)) for k, v in self.model.exact.items()})
        extra_bytes = sum(len(a.data) for a in extras.values())
        dense = None
        self.sent_bytes, self.sent_kind = {}, {}
        forms = []
        for node, cfg in zip(nodes, configs):
            cfg = {**cfg, MODEL_VERSION: self.version}
            plan = plan_message(self.nodes, node, payload, self._start, self.model.dense_bytes - extra_bytes,
                                lambda base, held: self._diff(server_round, node, base, g, held), self.exact_catchup)
            if plan.kind is PlanKind.DENSE:
                dense = dense or self.model.record(check=False)
                rec = ArrayRecord(dict(dense.items()))
                self.nodes.send(node, self.version)
            else:
                rec = ArrayRecord()
                if plan.kind.first_contact:
                    cfg[INIT_SEED] = self._start_init.seed
                    for k in self.model.keys:
                        if k in self.lossy_keys:
                            spec = self.model.specs[k]
                            rec[k] = Array(dtype=spec.dtype, shape=spec.shape, stype=INIT_STYPE,
                                           data=self._start_init.rule(k))
                        else:  # the node knows nothing of the model yet: plain arrays with dtype and shape
                            dense = dense or self.model.record(check=False)
                            rec[k] = dense[k]
                else:
                    cfg[BASE_VERSION] = plan.base_version
                    for k, a in extras.items():
                        rec[k] = a
                    if self.stat_deltas and node in self.nodes.stats and plan.kind is PlanKind.HELD:
                        self._keep_stats(node, rec)  # only values that are safe to apply twice (a replay)
                    elif self.stat_deltas and node in self.nodes.stats:
                        self._stat_changes(node, rec)
                for i, p in enumerate(plan.parts):
                    rec[chain_key(i)] = payload_array(p)
                self.nodes.send(node, self.version, plan.diff, keep=plan.kind is PlanKind.HELD)
            if self.stat_deltas and not self.nodes.stats_sent(node):  # sent the statistics exactly
                self.nodes.send_stats(node, self._exempt_copy())
            self.sent_bytes[node] = sum(len(a.data) for a in rec.values())
            self.sent_kind[node] = plan.kind
            forms.append((rec, cfg))
        return forms

    def _exempt_copy(self, source: FlatModel | None = None) -> FlatModel:
        """A copy of the BatchNorm statistics of ``source`` (default: the global ones, as this round's B
        holds them) as a model of their own."""
        source = self.model if source is None else source
        return FlatModel({k: source[k].copy() for k in self.exempt_keys},
                         {k: self.model.specs[k].dtype for k in self.exempt_keys})

    def _stat_changes(self, node: int, rec: ArrayRecord) -> None:
        """Replace the exact statistics in ``rec`` by their change since ``node``'s copy (one
        ``sign`` payload per tensor) and record what the node will hold once it replies."""
        held = self._exempt_copy(self.nodes.stats[node])
        sign = get_compressor(BATCHNORM_STATS_CODEC)
        for k in self.exempt_keys:
            del rec[k]
            spec = held.specs[k]
            change = np.asarray(self.model.float_view(k), np.float32) - np.asarray(held.float_view(k), np.float32)
            payload = sign.compress(torch.from_numpy(np.ascontiguousarray(change.reshape(-1))))
            rec[stat_delta_key(k)] = payload_array(payload)
            apply_stat_delta(held, k, decompress(payload, max_numel=max(spec.numel, 1),
                                                 expected_shape=(spec.numel,)).numpy())
        self.nodes.send_stats(node, held)

    def _keep_stats(self, node: int, rec: ArrayRecord) -> None:
        """A message with no step (`PlanKind.HELD`) leaves ``node``'s BatchNorm statistics as it holds them:
        a change applied twice (a replayed message) would move them off the server's record."""
        for k in self.exempt_keys:
            del rec[k]
        self.nodes.send_stats(node, self.nodes.stats[node])

    def _broadcast_step(self, target: FlatModel, b: np.ndarray, server_round: int,
                        step: SharedStep | None) -> tuple[bytes, np.ndarray]:
        """This round's broadcast payload from B_{v-1} = ``b`` towards ``target`` and B_v: the shared step
        when there is one, lands within `SHARED_STEP_TOLERANCE` of the target (L2, over the compressed
        part) and leaves no running variance below 0; else the codec's step."""
        g = self._lossy(target)
        change = g - b
        try:
            shared = None if step is None else step.payload(self._float_segments(target))
            after = None if shared is None else self._round_to_dtypes(b + self._decode(shared))
        except (ValueError, struct.error) as exc:  # PayloadError too: a sum that does not fit, the codec's step
            log(WARNING, "fedcomp downstream: the round's shared step does not fit the model (%s)", exc)
            after = None
        if after is not None and not self._negative_variance(after):
            left = np.linalg.norm((g - after).astype(np.float64))
            if left <= SHARED_STEP_TOLERANCE * np.linalg.norm(change.astype(np.float64)):
                return shared, after
        payload = self._compress(change, server_round)
        return payload, self._round_to_dtypes(b + self._decode(payload))

    def _negative_variance(self, vec: np.ndarray) -> bool:
        """Whether a compressed-part vector holds a negative BatchNorm running variance (nodes refuse it)."""
        off = 0
        for k, n in zip(self.lossy_keys, self.sizes):
            if is_running_var(k) and n and float(vec[off: off + n].min()) < 0:
                return True
            off += n
        return False

    def _float_segments(self, model: FlatModel) -> list[tuple[int, int]]:
        """The compressed part's tensors as ``(offset, length)`` runs of ``model.flat`` (every float tensor in
        model order: the shared projection's coordinates), empty ones left out, adjacent ones merged."""
        out: list[tuple[int, int]] = []
        for off, n in segments(model, self.lossy_keys):
            if n and out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + n)
            elif n:
                out.append((off, n))
        return out

    def _diff(self, server_round: int, node: int, base: Base, g: np.ndarray, held: np.ndarray) -> bytes:
        """``C(G - held)`` for ``node``. A codec that draws nothing from its seed (sign, STC, top-k,
        fp16, ...) gives every node with the same shared base (the start, a version u) the
        same bytes: it is encoded once per round and the bytes are shared (1000 nodes, 10 % a round:
        ~100 encodes of the whole model a round were the same one). Seeded codecs and private copies
        are encoded per node."""
        if base.kind is BaseKind.PRIVATE or CODECS[self.compressor].seeded:
            return self._compress(g - held, server_round, node)
        if base not in self._round_diffs:
            self._round_diffs[base] = self._compress(g - held, server_round, node)
        return self._round_diffs[base]

    def _compressed_start(self, server_round: int, target: FlatModel) -> None:
        """B_1 := the initial model compressed from zero with the first-contact codec (server-side
        error feedback keeps ``G - B_1``); every new node gets that one start payload."""
        codec = self.init if isinstance(self.init, str) and self.init not in INIT_POLICIES else START_CODEC
        first = self.nodes.versions[1]
        payload = self._compress(first, server_round, compressor=codec)
        # in the flat's dtype (float64 for a float64 model), as the client adds the start to its zeros
        b1 = self._round_to_dtypes(self._decode(payload).astype(first.dtype))
        if len(payload) >= self.model.dense_bytes:
            return  # nothing to gain: new nodes get the model dense
        self._start = [payload]
        self.nodes.set_start(b1, first=True)
        self._start_init = SeededInit(0, dict.fromkeys(self.lossy_keys, 0.0))
        scatter(self.model, self.lossy_keys, b1)

    def _check_init(self, target: FlatModel) -> np.ndarray | None:
        """The compressed part of the seeded initial model if the first global model equals it."""
        if not isinstance(self.init, SeededInit):
            return None
        try:
            vals = self.init.values({k: target.specs[k].shape for k in self.lossy_keys})
            vec = self._round_to_dtypes(np.concatenate([vals[k].reshape(-1) for k in self.lossy_keys])
                               if self.lossy_keys else np.zeros(0, np.float32))
        except (KeyError, ValueError) as exc:
            log(WARNING, "fedcomp downstream: the seeded init does not describe this model (%s); new clients "
                "get a compressed start", exc)
            return None
        if self.init.exact:  # tensors the seed does not draw: their values ride in the start payload
            vec, self._start = self._exact_start(vec)
        if not np.array_equal(vec, self.nodes.versions[1]):
            self._start = []
            log(WARNING, "fedcomp downstream: the initial global model is not the seeded init; "
                "new clients get a compressed start")
            return None
        self._start_init = self.init
        return vec

    def _exact_start(self, vec: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
        """The seeded start ``vec`` plus the exact values of `SeededInit.exact`'s tensors (zeros
        in ``vec``): one ``topk`` payload keeping exactly the non-zero entries of ``B_1 - vec`` (fp32
        values); ``(B_1 as a new node rebuilds it, [that payload])``, or ``(vec, [])`` with nothing to add."""
        first, rest, off = self.nodes.versions[1], np.zeros(vec.size, np.float32), 0
        for k, size in zip(self.lossy_keys, self.sizes):  # elsewhere the seed must describe the model itself
            if k in self.init.exact:
                rest[off: off + size] = first[off: off + size] - vec[off: off + size]
            off += size
        nnz = int(np.count_nonzero(rest))
        if nnz == 0:
            return vec, []
        n = rest.size
        density = nnz / n if round(nnz / n * n) == nnz else 1.0
        payload = get_compressor("topk", density=density).compress(torch.from_numpy(rest))
        return self._round_to_dtypes(vec + self._decode(payload).astype(vec.dtype)), [payload]

    def settings(self) -> dict:
        """What the download resolved to, every ``"auto"`` replaced (for a run's record): ``codec``,
        ``density`` (None: the codec has none, or the upload's applies), ``first-contact`` (``"seeded"``,
        ``"compressed with <codec>"``, ``"dense"``; the policy while no round has run yet), ``catch-up``,
        ``correction`` and ``max-copies`` (the copy budget in model copies)."""
        if self.model is None:
            first = self.init if isinstance(self.init, str) else "seeded"
        elif self.nodes.start is None:
            first = "dense"
        elif self._start_init is not None and self._start_init is self.init:
            first = "seeded"
        else:
            codec = self.init if isinstance(self.init, str) and self.init not in INIT_POLICIES else START_CODEC
            first = f"compressed with {codec}"
        return {"codec": self.compressor, "density": self.density, "first-contact": first,
                "catch-up": "exact" if self.exact_catchup else "smallest", "correction": self.correction,
                "max-copies": float(self.nodes.copy_budget())}

    def received(self, node: int, digest: bytes | None = None) -> bool:
        """``node`` replied this round, so it holds what it was sent (a diff's copy rebuilt here).

        ``digest``: the digest of the copy the node reports holding (`fedcomp.download.layout.copy_digest`;
        None: not checked). When it differs from the digest of the server's record of that copy (a node
        whose generator drew the seeded start differently, a copy changed on the node), the node is
        forgotten: its next message is a first contact, which replaces its copy whatever it held (a counted
        re-synchronisation, `resynced`). Returns whether the node's copy is known now."""
        verify = None if digest is None else lambda: self.copy_digest(node) == digest
        known = self.nodes.commit(node, lambda base, diff: self._round_to_dtypes(base + self._decode(diff)), verify)
        if not known and digest is not None:
            self.resynced.append(node)
        return known

    def note_replies(self, stats: list[dict], fold=None, sent: FlatModel | None = None,
                     digests: dict[int, bytes] | None = None) -> int:
        """Each replying node (``stats``: per-client figures with ``node``) holds what it was sent
        (`received`); its ``download-bytes`` becomes the bytes the server sent it this round.

        With `correction` and the round's ``fold`` (its ``weights``: node -> weight, complete)
        and global model ``sent``, each reply is counted from ``sent`` rather than from the copy its
        client trained from (`fedcomp.download.correction.correct_for_copies`): a private copy as soon as
        its node is committed, before committing the next reply can make the copy budget forget it (so
        the round holds one private copy beyond the budget at a time, whatever the number of clients);
        the nodes on the broadcast version in one pass at the end (after its commit a node holds either
        its own copy or the latest version, which the budget never forgets). A node whose copy the
        server did not know (its catch-up's base forgotten before it replied) is folded as it came.
        ``digests``: node -> the digest of the copy it reports (`received`; None: not checked).
        Returns the copies folded in.

        Raises
        ------
        ValueError
            A ``fold`` with per-client weights and a correction, but no ``sent``.
        """
        weights = getattr(fold, "weights", None) if self.correction and self.model is not None else None
        if isinstance(weights, dict) and sent is None:
            raise ValueError("note_replies: the downstream correction needs the round's global model (sent)")
        versions: dict[Base, list] = {}
        done = 0
        for stat in stats:
            node = stat["node"]
            self.received(node, None if digests is None else digests.get(node))
            stat["download-bytes"] = float(self.sent_bytes.get(node, 0))
            if not isinstance(weights, dict) or node not in weights or (found := self.nodes.copy_of(node)) is None:
                continue
            key, vec = found
            if key.kind is BaseKind.PRIVATE:
                done += correct_for_copies(fold, self.lossy_keys, sent, [(vec, weights[node])], self.correction)
                found = vec = None  # no reference past its fold: the budget may forget it at the next commit
            else:
                versions.setdefault(key, [vec, 0.0])[1] += weights[node]
        if versions:
            done += correct_for_copies(fold, self.lossy_keys, sent, [(v, w) for v, w in versions.values()],
                                       self.correction)
        return done

    def held(self, node: int) -> np.ndarray | None:
        """Every float tensor (flat, model order) the server believes ``node`` holds (None: unknown)."""
        model = self._held_model(node)
        return None if model is None else model.flat

    def copy_digest(self, node: int) -> bytes | None:
        """The digest of the model the server believes ``node`` holds (`fedcomp.download.layout.copy_digest`
        of `held`), computed tensor by tensor from the pieces the server keeps: no model-sized copy
        (None: unknown)."""
        vec = self.nodes.held(node)
        if vec is None:
            return None
        stats = self.nodes.stats.get(node)
        lossy, exempt, off = set(self.lossy_keys), set(self.exempt_keys), 0
        def segments():
            nonlocal off
            for k in self.model.float_keys:
                if k in lossy:
                    n = self.model.specs[k].numel
                    yield vec[off: off + n]
                    off += n
                elif stats is not None and k in exempt:
                    yield stats.float_view(k).reshape(-1)
                else:
                    yield self.model.float_view(k).reshape(-1)
        return digest_segments(segments(), self.model.flat.dtype)

    def _held_model(self, node: int) -> FlatModel | None:
        """The model the server believes ``node`` holds, every tensor (None: unknown)."""
        vec = self.nodes.held(node)
        if vec is None:
            return None
        out = FlatModel({k: v for k, v in self.model.items()}, {k: s.dtype for k, s in self.model.specs.items()})
        scatter(out, self.lossy_keys, vec)
        for k in self.exempt_keys if node in self.nodes.stats else []:
            out.float_view(k)[...] = self.nodes.stats[node].float_view(k)
        return out
