"""fedcomp's codecs as a PyTorch DDP communication hook.

::

    from fedcomp.distributed import CompressionState, compression_hook
    state = CompressionState(process_group=None, compressor="stc", density=0.01)
    ddp_model.register_comm_hook(state, compression_hook)

DDP hands the hook one bucket at a time: a flat buffer holding this rank's summed gradients of the
bucket's parameters (not yet divided by the world size). [`compression_hook`][fedcomp.distributed.compression_hook]
replaces it with the mean over the ranks, sent compressed by `fedcomp.distributed.exchange.average`: an allreduce where
the compressed form sums (``none``, ``fp16``; PowerSGD's factors, `fedcomp.distributed.lowrank`), otherwise an
all-gather of the payloads (sizes first) that every rank decodes and sums in rank order, so the replicas stay
bit-identical. Error feedback keeps per
bucket what was not sent and adds it to the next step's gradient.

The collectives run synchronously inside the hook and the returned future is already completed: DDP
cannot overlap this bucket's communication with the rest of the backward pass (the codecs encode and
decode on the host between two collectives anyway).

Sources: Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019 (the state object and hook, error feedback per bucket, warm-up of plain
allreduce); Lin et al., "Deep Gradient Compression", ICLR 2018 (sparsification with warm-up);
Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019;
Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems", MLSys 2022
(all-gather for codecs whose payloads do not sum).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against dist.GradBucket.
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fedcomp.compression import CODECS, Compressor, ErrorFeedback, get_compressor
from fedcomp.compression.error_feedback import RESIDUAL, check_error_feedback, error_feedback_default
from fedcomp.distributed.exchange import ByteCount, CompressionError, average
from fedcomp.distributed.lowrank import ALLREDUCE_LOW_RANK, powersgd_allreduce
from fedcomp.util.validate import check_number

logger = logging.getLogger(__name__)

#: What the hook does when a gradient holds NaN/Inf.
NONFINITE = ("raise", "propagate")
#: Version of `CompressionState.state_dict`'s layout.
STATE_VERSION = 1


class CompressionState:
    """Settings and memory of [`compression_hook`][fedcomp.distributed.compression_hook]: the codec, error feedback per
    bucket, the step counter and the byte counters.

    Pass it to ``ddp_model.register_comm_hook(state, compression_hook)`` once, before the first
    backward pass. Every rank builds it with the same settings.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group DDP averages over; None (default): the default group. Not saved by
        [`state_dict`][fedcomp.distributed.CompressionState.state_dict] nor pickled (a restored state uses the default
        group).
    compressor : str
        A codec of [`fedcomp.compression.get_compressor`][]: "none", "fp16", "bf16", "sign", "stc",
        "topk", "randomk", "qsgd", "int8", "eden", "powersgd", ... Default "stc".
        "none" and "fp16" go through one allreduce (the same as DDP's default hook and torch's
        ``fp16_compress_hook``); "powersgd" through two allreduces per bucket, of its P and Q factors
        (`fedcomp.distributed.lowrank`, as the paper and torch's ``powerSGD_hook`` run it); every other
        codec through an all-gather of payloads. Other codecs that work per tensor only (ATOMO)
        compress each parameter's gradient, viewed in its own shape, as a payload of its own; every
        other codec compresses the whole bucket as one vector (top-k and STC select over the bucket).
    error_feedback : bool, optional
        Keep what was not sent per bucket and add it to the next step's gradient (Seide et al. 2014,
        Karimireddy et al. 2019). Default None: on for every codec except the dense casts ("none",
        "fp16", "bf16"), which then match torch's own hooks, and the unbiased codecs with which it would
        diverge (`fedcomp.compression.Compressor.error_feedback_refusal`: ATOMO, QSGD with few levels). Refused
        off for codecs that need it (PowerSGD), and on for those.
    warmup_steps : int, optional
        Optimizer steps (synchronising backward passes) whose buckets go as a plain fp32 allreduce
        before compression starts; >= 0. Default None: 1 with error feedback, 0 without (the dense
        casts then match torch's hooks from the first step). One step because the first runs on DDP's
        provisional buckets (one bucket of every parameter; DDP rebuilds them from the order in which
        gradients became ready) and sends the exact mean gradient once. Correctness does not depend on
        it (residuals are kept per parameter, so a rebuild carries them over); it is an accuracy knob:
        low densities early in training gain from longer warm-ups (DGC's warm-up epochs; PowerSGD's
        ``start_powerSGD_iter``), at 4 bytes per gradient entry per warm-up step.
    min_compression_numel : int, optional
        Buckets with fewer gradient entries go as a plain fp32 allreduce, uncompressed and without
        error feedback; >= 0. Default None: 1024 with error feedback (4 KiB in fp32: below it the
        all-gather's two collectives and the payload headers cost about what they save, and a
        density-0.01 codec would keep about 10 entries), 0 without (the dense casts cast every
        bucket, as torch's hooks do). 0 compresses every bucket.
    nonfinite : {"raise", "propagate"}
        A NaN/Inf gradient on any rank: "raise" (default) raises on every rank, naming the codec, the
        bucket and (codecs exchanged by all-gather) the rank; "propagate" fills the bucket's mean with NaN on
        every rank (what ``torch.amp.GradScaler`` needs to skip the step, as it does with DDP's own allreduce).
    seed : int
        Base seed of the stochastic codecs (randomk, qsgd, int8, eden, powersgd's first Q): each call
        draws from a seed derived from ``(seed, rank, step, bucket)``, so a restored state redraws the
        same numbers and ranks draw independently. In ``[0, 2**63)``; default 0.
    **codec_options
        The codec's own options (``density``, ``levels``, ``block_size``, ``rank``, ``value_dtype``,
        ...), passed to [`fedcomp.compression.get_compressor`][].

    Attributes
    ----------
    step : int
        Optimizer steps seen (backward passes that synchronised: a ``no_sync()`` micro-batch does not
        count).
    bytes : ByteCount
        Bytes this rank handed to the collectives (``sent``, payloads, sizes and padding included) and
        what an fp32 allreduce of the same buckets would have handed (``dense``), warm-up included.

    Raises
    ------
    ValueError
        A bad setting, naming the argument: unknown codec, a codec option out of its range or unknown
        to the codec, a negative ``warmup_steps``, ...
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, compressor: str = "stc", *,
                 error_feedback: bool | None = None, warmup_steps: int | None = None,
                 min_compression_numel: int | None = None,
                 nonfinite: str = "raise", seed: int = 0, **codec_options: Any) -> None:
        if not isinstance(compressor, str) or compressor not in CODECS:
            raise ValueError(f"compressor must be one of {sorted(CODECS)}, got {compressor!r}")
        codec = CODECS[compressor]
        self.seed = check_number(seed, "seed", lo=0, hi=2**63 - 1, integer=True, exact_type=True)
        if "seed" in codec_options:  # unreachable through keywords; a mapping could still carry it
            raise ValueError("seed is the state's argument, not a codec option")
        self.template = get_compressor(compressor, **codec_options)  # ValueError naming the option
        self.seeded = codec.seeded
        self.per_tensor = codec.per_tensor_only
        if error_feedback is None:
            error_feedback = error_feedback_default(self.template)
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True, False or None, got {error_feedback!r}")  # noqa: TRY004
        if not error_feedback and codec.requires_error_feedback:
            raise ValueError(f"error_feedback=False is refused for {compressor!r}: {codec.requires_error_feedback}")
        if error_feedback:
            check_error_feedback(self.template, "error_feedback")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {list(NONFINITE)}, got {nonfinite!r}")
        self.process_group = process_group
        self.compressor = compressor
        self.codec_options = dict(codec_options)
        self.error_feedback = error_feedback
        if warmup_steps is None:
            warmup_steps = 1 if error_feedback else 0
        self.warmup_steps = check_number(warmup_steps, "warmup_steps", lo=0, integer=True, exact_type=True)
        if min_compression_numel is None:
            min_compression_numel = 1024 if error_feedback else 0
        self.min_compression_numel = check_number(min_compression_numel, "min_compression_numel", lo=0,
                                                  integer=True, exact_type=True)
        self.nonfinite = nonfinite
        self.step = 0
        self.bytes = ByteCount()
        self.plain = get_compressor("none")
        # Memory, keyed so that it survives DDP's bucket rebuild and a checkpoint: every parameter gets
        # the key "<bucket>.<position>" of its first bucket (step 0 runs on DDP's initial buckets, which
        # depend only on the model and the bucket size, so a restarted run assigns the same keys).
        self.keys: dict[int, str] = {}
        self.feedback: dict[int | str, ErrorFeedback] = {}  # bucket index, or parameter key (per tensor)
        self.layouts: dict[int, tuple[str, ...]] = {}  # bucket index -> keys of the residual it holds
        self.owner: dict[str, int] = {}  # parameter key -> the bucket whose residual holds its piece
        # the buckets of a restored run (index -> keys): DDP's provisional first bucket is compressed
        # along them, as the saved run did after its rebuild
        self.saved_layouts: dict[int, tuple[str, ...]] = {}
        self.sent_layouts: dict[int, tuple[str, ...]] = {}  # bucket index -> keys, every bucket of the last step
        self.numels: dict[str, int] = {}
        self._bucket_keys: dict[int, tuple[tuple[int, ...], tuple[str, ...]]] = {}  # index -> (ids, keys)
        self.codecs: dict[int | str, Compressor] = {}  # stateful codecs without error feedback
        self.pending: dict[str, dict[str, np.ndarray]] = {}  # parameter key -> restored entries
        logger.info("CompressionState: compressor=%s %s, error_feedback=%s, warmup_steps=%d, "
                    "min_compression_numel=%d, nonfinite=%s", compressor, self.codec_options, error_feedback,
                    self.warmup_steps, self.min_compression_numel, nonfinite)

    # -- pickling, as torch's PowerSGDState: the process group does not travel ------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group (restored as the default group) and the keys cached per bucket
        (object ids of this process's parameters)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("process_group", "_bucket_keys")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None
        self._bucket_keys = {}

    # -- what the hook calls, one small step each ---------------------------------------------------

    def parameter_keys(self, index: int, bucket: dist.GradBucket) -> list[str]:
        """The keys of the bucket's parameters, assigning ``"<index>.<position>"`` to each unseen one.

        A bucket that holds the same parameters as at its last call gets the keys found then: once DDP has
        settled on its buckets, every call skips the loop over the parameters and their gradients (a
        fixed cost per call that weighs on small and medium buckets)."""
        params = bucket.parameters()
        ids = tuple(map(id, params))
        seen = self._bucket_keys.get(index)
        if seen is not None and seen[0] == ids:
            return list(seen[1])
        keys = []
        for pos, (param, grad) in enumerate(zip(params, bucket.gradients())):
            key = self.keys.setdefault(id(param), f"{index}.{pos}")
            self.numels[key] = grad.numel()
            keys.append(key)
        self._bucket_keys[index] = (ids, tuple(keys))
        return keys

    def compresses(self, numel: int) -> bool:
        """Whether a bucket of ``numel`` entries is compressed at the current step (after warm-up,
        and not below ``min_compression_numel``)."""
        return self.step >= self.warmup_steps and numel >= max(self.min_compression_numel, 1)

    def bucket_feedback(self, index: int, keys: list[str]) -> ErrorFeedback | None:
        """The bucket's error feedback (None without), its residual laid out for ``keys``.

        After DDP rebuilt its buckets, or after
        [`load_state_dict`][fedcomp.distributed.CompressionState.load_state_dict], a bucket's parameters differ from
        those its residual was kept for: the residuals that hold any of them are cut into their parameters' pieces and
        the bucket reassembles its own from them (a parameter never seen with a residual starts from zero). In steady
        state nothing is cut or copied.
        """
        if not self.error_feedback:
            return None
        layout = tuple(keys)
        if self.layouts.get(index) != layout:
            # free this bucket's old residual and every other bucket's that holds one of these parameters
            stale = {self.owner[k] for k in keys if k in self.owner} | ({index} if index in self.layouts else set())
            for other in sorted(stale):
                self.unpack_residual(other)
            ef = self.feedback.setdefault(index, ErrorFeedback(self.template))
            pieces = [self.pending.get(k, {}).pop(RESIDUAL, None) for k in keys]
            if any(p is not None for p in pieces):
                ef.set_residual(torch.cat([torch.zeros(self.numels[k]) if p is None else
                                           torch.as_tensor(p, dtype=torch.float32).reshape(-1)
                                           for k, p in zip(keys, pieces)]))
            self.layouts[index] = layout
            self.owner.update({k: index for k in keys})
        return self.feedback[index]

    def layout_groups(self, keys: list[str]) -> list[tuple[int, tuple[str, ...]]] | None:
        """The saved buckets a bucket of ``keys`` is compressed along, or None (compressed whole).

        A resumed DDP runs its first step on one provisional bucket of every parameter; when that
        bucket is made of several buckets of the saved run
        ([`load_state_dict`][fedcomp.distributed.CompressionState.load_state_dict]), each is compressed on its own, in
        index order, as the saved run would have: the resumed step is the saved run's next step, bit for bit.
        """
        if not self.saved_layouts or tuple(keys) in self.saved_layouts.values():
            return None
        have = set(keys)
        groups = [(i, lay) for i, lay in sorted(self.saved_layouts.items()) if set(lay) <= have]
        if len(groups) < 2 or sum(len(lay) for _, lay in groups) != len(have):
            return None
        return groups

    def record_layout(self, index: int, layout: tuple[str, ...]) -> None:
        """Note that bucket ``index`` holds the parameters ``layout`` now, whatever went (compressed, plain below
        ``min_compression_numel`` or in warm-up, per tensor, PowerSGD), for
        [`state_dict`][fedcomp.distributed.CompressionState.state_dict]'s ``"layouts"``. A bucket that held any of
        them before is forgotten."""
        if self.sent_layouts.get(index) != layout:
            have = set(layout)
            for other in [i for i, lay in self.sent_layouts.items() if i != index and have & set(lay)]:
                del self.sent_layouts[other]
            self.sent_layouts[index] = layout

    def unpack_residual(self, index: int) -> None:
        """Cut bucket ``index``'s residual into its parameters' pieces, kept until a bucket claims them."""
        layout = self.layouts.pop(index)
        ef = self.feedback.get(index)
        if ef is not None and ef.residual is not None:
            sizes = [self.numels[k] for k in layout]
            for key, piece in zip(layout, ef.residual.reshape(-1).split(sizes)):
                self.pending.setdefault(key, {})[RESIDUAL] = piece.detach().cpu().numpy().copy()
            ef.set_residual(None)
        for key in layout:
            if self.owner.get(key) == index:
                del self.owner[key]

    def tensor_feedback(self, key: str) -> ErrorFeedback | None:
        """Error feedback of one parameter's gradient (codecs that work per tensor), its restored state
        applied on first use; None without error feedback."""
        if not self.error_feedback:
            return None
        if key not in self.feedback:
            ef = self.feedback[key] = ErrorFeedback(get_compressor(self.compressor, **self.codec_options))
            ef.set_state(self.pending.pop(key, {}))
        return self.feedback[key]

    def codec_for(self, slot: int | str, feedback: ErrorFeedback | None) -> Compressor:
        """The codec for this call: the shared one, or for stochastic codecs a fresh one seeded from
        ``(seed, rank, step, slot)`` that carries on the previous one's state (PowerSGD's Q)."""
        previous = feedback.compressor if feedback is not None else self.codecs.get(slot)
        if not self.seeded:
            return previous if previous is not None else self.template
        rank = dist.get_rank(self.process_group)
        salt = [int(x) for x in str(slot).split(".")]
        seed = int(np.random.SeedSequence([self.seed, rank, self.step, *salt]).generate_state(2, np.uint64)[0] >> 1)
        codec = get_compressor(self.compressor, **self.codec_options, seed=seed)
        if previous is not None:
            codec.set_state(previous.get_state())
        if feedback is not None:
            feedback.compressor = codec
        else:
            self.codecs[slot] = codec
        return codec

    def count_step(self, bucket: dist.GradBucket) -> None:
        """Advance `step` after the last bucket of a backward pass."""
        if bucket.is_last():
            self.step += 1

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: settings, step, byte counters and the error-feedback memory.

        Returns
        -------
        dict
            ``"version"``, ``"compressor"``, ``"codec_options"``, ``"error_feedback"``, ``"warmup_steps"``,
            ``"min_compression_numel"``, ``"seed"``, ``"step"``, ``"bytes_sent"``, ``"bytes_dense"`` and
            ``"memory"``: ``{parameter key: {entry: CPU tensor}}`` with entry ``"residual"`` (float32,
            the parameter's number of gradient entries) and the codec's own state
            (``"powersgd/q"``, ...); ``"layouts"``: ``{bucket index: [parameter key, ...]}``, the
            buckets of the last step. Saves with ``torch.save``; ranks hold different residuals, so every
            rank saves its own.
        """
        memory: dict[str, dict[str, torch.Tensor]] = {k: {n: torch.as_tensor(a).clone() for n, a in e.items()}
                                                      for k, e in self.pending.items()}
        for slot, ef in self.feedback.items():
            if isinstance(slot, str):  # per tensor: the whole state of the parameter's feedback
                memory.setdefault(slot, {}).update({n: torch.from_numpy(a) for n, a in ef.get_state().items()})
            elif ef.residual is not None and slot in self.layouts:
                sizes = [self.numels[k] for k in self.layouts[slot]]
                for key, piece in zip(self.layouts[slot], ef.residual.reshape(-1).split(sizes)):
                    memory.setdefault(key, {})[RESIDUAL] = piece.detach().to("cpu", torch.float32, copy=True)
        return {"version": STATE_VERSION, "compressor": self.compressor, "codec_options": dict(self.codec_options),
                "error_feedback": self.error_feedback, "warmup_steps": self.warmup_steps,
                "min_compression_numel": self.min_compression_numel, "seed": self.seed, "step": self.step,
                "bytes_sent": self.bytes.sent, "bytes_dense": self.bytes.dense, "memory": memory,
                "layouts": {i: list(lay) for i, lay in (self.sent_layouts or self.saved_layouts).items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what [`state_dict`][fedcomp.distributed.CompressionState.state_dict] returned (this rank's own).

        Call it before the first backward pass of the resumed run, on a DDP model built as the saved
        run's was (same parameters, same ``bucket_cap_mb``). The memory is matched to the parameters by
        their keys; the resumed DDP's provisional first bucket is compressed along the saved run's
        buckets ([`layout_groups`][fedcomp.distributed.CompressionState.layout_groups]), so the resumed run continues
        bit for bit (PowerSGD's allreduces too: they sum each saved bucket's factors as the saved run did).
        Should the resumed DDP settle on other buckets, the residuals still carry over per parameter.

        Raises
        ------
        ValueError
            Another layout version, codec, codec options or error-feedback setting than this state's
            (naming it), or a non-finite residual.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"state version {state.get('version')!r} is not {STATE_VERSION}")
        for name in ("compressor", "codec_options", "error_feedback"):
            if state.get(name) != getattr(self, name):
                why = (f" (error feedback diverges with this codec and is off by default: {refusal}; that state's "
                       f"residual is of no use: start the hook's state afresh, the model and optimizer still load)"
                       if name == "error_feedback" and (refusal := self.template.error_feedback_refusal()) else "")
                raise ValueError(f"the saved state's {name} is {state.get(name)!r}, "
                                 f"this state's {getattr(self, name)!r}{why}")
        memory = {str(k): {str(n): torch.as_tensor(t).detach().cpu().numpy() for n, t in e.items()}
                  for k, e in state.get("memory", {}).items()}
        for key, entries in memory.items():
            for name, arr in entries.items():
                if not np.isfinite(arr).all():
                    raise ValueError(f"the saved state's {name} of parameter {key} holds NaN/Inf")
        self.step = int(state["step"])
        self.bytes = ByteCount(int(state.get("bytes_sent", 0)), int(state.get("bytes_dense", 0)))
        self.feedback, self.layouts, self.owner, self.codecs, self.sent_layouts = {}, {}, {}, {}, {}
        self.saved_layouts = {int(i): tuple(str(k) for k in lay) for i, lay in state.get("layouts", {}).items()}
        self.pending = memory

    def residual(self, index: int) -> torch.Tensor | None:
        """The residual bucket ``index`` holds now (flat, float32, the bucket's entries), or None."""
        ef = self.feedback.get(index)
        return None if ef is None else ef.residual

    def compression_stats(self) -> dict[str, float]:
        """``{"step", "bytes_sent", "bytes_dense", "ratio"}``: this rank's totals so far (ratio = dense / sent)."""
        return {"step": self.step, "bytes_sent": self.bytes.sent, "bytes_dense": self.bytes.dense,
                "ratio": self.bytes.ratio}


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean over the ranks of the bucket's gradients, sent compressed.

    Register with ``ddp_model.register_comm_hook(state, compression_hook)``. Runs its collectives
    synchronously and returns an already completed future; collectives are issued in the same order on
    every rank (bucket by bucket, as DDP calls the hook).

    Parameters
    ----------
    state : CompressionState
        The settings and memory (error feedback per bucket, step, byte counters).
    bucket : torch.distributed.GradBucket
        DDP's bucket: a flat buffer (fp32, fp16 or bf16; CPU or CUDA) holding this rank's gradients,
        summed over its micro-batches, not yet divided by the world size.

    Returns
    -------
    torch.futures.Future[torch.Tensor]
        Completed; its value is the bucket's buffer, overwritten with the mean over the ranks (in the
        buffer's dtype), bit-identical on every rank.

    Raises
    ------
    ValueError
        On every rank alike, naming the codec, the bucket and the step: a rank's gradient holds NaN/Inf
        (``nonfinite="raise"``), or a payload that does not decode. DDP passes it on from ``backward()``.
    RuntimeError
        From ``torch.distributed``: another rank died or stopped answering (after the process group's
        timeout).
    """
    buffer = bucket.buffer()
    index = bucket.index()
    keys = state.parameter_keys(index, bucket)
    try:
        if (groups := state.layout_groups(keys)) is not None:
            mean = _average_by_layout(state, bucket, keys, groups)
        else:
            state.record_layout(index, tuple(keys))
            mean = _average_bucket(state, index, buffer, bucket.gradients(), keys)
    except CompressionError as err:
        if state.nonfinite == "raise":
            raise ValueError(f"compression_hook: codec {state.compressor!r}, bucket {index}, step {state.step}: "
                             f"{err}") from err
        mean = torch.full_like(buffer, float("nan"))
    except ValueError as err:  # a payload that does not decode (PayloadError), a residual of another shape
        raise ValueError(f"compression_hook: codec {state.compressor!r}, bucket {index}, step {state.step}: "
                         f"{err}") from err
    buffer.copy_(mean.reshape(buffer.shape))
    state.count_step(bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _average_bucket(state: CompressionState, index: int, flat: torch.Tensor, grads: list[torch.Tensor],
                    keys: list[str]) -> torch.Tensor:
    """The mean of one bucket (or one saved bucket's part of a resumed provisional one): ``flat`` its entries,
    ``grads`` its gradients in their shapes, ``keys`` their parameter keys; plain fp32 in warm-up or below
    ``min_compression_numel``, else compressed the codec's way."""
    group, count = state.process_group, state.bytes
    if not state.compresses(flat.numel()):
        return average(flat, state.plain, None, group, count)
    if state.compressor in ALLREDUCE_LOW_RANK:
        return powersgd_allreduce(state, grads, keys, group, count)
    if state.per_tensor:  # each parameter's gradient, in its own shape, a payload of its own
        pieces = [torch.zeros(0, device=flat.device)]
        for key, grad in zip(keys, grads):
            feedback = state.tensor_feedback(key)
            pieces.append(average(grad, state.codec_for(key, feedback), feedback, group, count).reshape(-1))
        return torch.cat(pieces)
    feedback = state.bucket_feedback(index, keys)
    return average(flat, state.codec_for(index, feedback), feedback, group, count)


def _average_by_layout(state: CompressionState, bucket: dist.GradBucket, keys: list[str],
                       groups: list[tuple[int, tuple[str, ...]]]) -> torch.Tensor:
    """The mean of a resumed DDP's provisional bucket, along the saved run's buckets ``groups``: each as the saved
    run sent it (`_average_bucket`), in index order, so that every collective sums what it summed then."""
    buffer = bucket.buffer()
    offsets, grads, off = {}, {}, 0
    for key, grad in zip(keys, bucket.gradients()):
        offsets[key], grads[key] = (off, grad.numel()), grad
        off += grad.numel()
    mean = torch.empty(buffer.numel(), dtype=torch.float32, device=buffer.device)
    for index, layout in groups:
        state.record_layout(index, layout)
        segment = torch.cat([buffer.narrow(0, *offsets[k]) for k in layout])
        part = _average_bucket(state, index, segment, [grads[k] for k in layout], list(layout)).reshape(-1)
        start = 0
        for k in layout:
            o, n = offsets[k]
            mean.narrow(0, o, n).copy_(part.narrow(0, start, n))
            start += n
    return mean
