"""DiLoCo: compressed outer synchronisation of data-parallel workers every ``sync_every`` inner steps.

Each rank trains its own copy of the model with its own inner optimizer; every H inner steps the
ranks exchange the *pseudo-gradient* ``start - now`` (how far each moved since the last outer
step), compressed with any fedcomp codec and error feedback, average it, and an outer optimizer
(SGD with Nesterov momentum by default) applies the mean to the parameters at the start of the
interval. Ranks' outer copies are bit-identical after every outer step, and so are the parameters
the step updated (unless ``mixing > 0``, see `DiLoCo`).

With ``fragments = F > 1`` the parameters are split into F contiguous fragments, each synchronised
every H inner steps, fragment f at inner steps ``t`` with ``t % H == ((f + 1) * H // F) % H``: the
traffic of one outer step is spread over the interval (Streaming DiLoCo).

With ``overlap_steps = tau > 0`` a fragment's exchange runs in the background while the rank takes
its next tau inner steps, and the fragment's outer update lands tau steps after its exchange began
(Streaming DiLoCo with overlapping communication). With ``tau = 0`` (the default) each exchange
blocks its ``step()`` call.

Sources: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023 (pseudo-gradient, outer SGD with Nesterov momentum, lr 0.7, momentum 0.9); Douillard et al.,
"Streaming DiLoCo with overlapping communication", 2025 (fragments; communication overlapped with
tau inner steps, the landed fragment mixed with the local one); Sarfi et al., "SparseLoCo:
Communication-Efficient LLM Training", 2025 (top-k pseudo-gradients with error feedback);
Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import functools
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fedcomp.compression import Compressor, ErrorFeedback, get_compressor
from fedcomp.compression.error_feedback import check_error_feedback, error_feedback_default
from fedcomp.distributed.exchange import ByteCount, CompressionError, average
from fedcomp.util.validate import check_number

#: The outer optimizer of the DiLoCo paper (Douillard et al. 2023, Sec. 3): SGD, Nesterov momentum.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
#: Version of the `DiLoCo.state_dict` layout (2 added ``pending``, ``overlap_steps`` and ``mixing``;
#: a version-1 checkpoint loads as one with neither).
STATE_VERSION = 2
#: Settings a version-1 checkpoint does not record, and their values there.
_V1_SETTINGS = {"overlap_steps": 0, "mixing": 0.0}


def default_outer_optimizer(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: ``SGD(params, lr=0.7, momentum=0.9, nesterov=True)``.

    Parameters
    ----------
    params : iterable of torch.Tensor
        The outer copies (fp32) the optimizer updates.

    Returns
    -------
    torch.optim.SGD
    """
    return torch.optim.SGD(params, lr=DEFAULT_OUTER_LR, momentum=DEFAULT_OUTER_MOMENTUM, nesterov=True)


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """Contiguous groups of parameter indices, of about equal numbers of entries.

    Parameters
    ----------
    sizes : list of int
        Entries of each parameter tensor, in model order.
    fragments : int
        Number of groups, 1 <= fragments <= len(sizes).

    Returns
    -------
    list of list of int
        ``fragments`` non-empty lists of consecutive indices covering ``range(len(sizes))``.
    """
    total, n = sum(sizes), len(sizes)
    groups: list[list[int]] = [[]]
    seen = 0
    for i, size in enumerate(sizes):
        to_open = fragments - len(groups)  # groups still to start after the current one
        # start the next group when the current one holds its share, or when every later group
        # needs one of the tensors left (this one included)
        if groups[-1] and to_open and (seen >= len(groups) * total / fragments or n - i <= to_open):
            groups.append([])
        groups[-1].append(i)
        seen += size
    return groups


@dataclass
class _Exchange:
    """One fragment's exchange: begun after inner step ``started``, its outer update due after ``lands``.
    ``future`` resolves to ``(mean, bytes sent)`` or to the exchange's exception."""

    fragment: int
    started: int
    lands: int
    future: concurrent.futures.Future


def _serve(jobs: queue.SimpleQueue) -> None:
    """The exchange thread: runs the jobs ``(fn, future)`` one at a time in the order they were queued
    (every rank queues the same exchanges in the same order, so their collectives match); None stops it."""
    while (job := jobs.get()) is not None:
        fn, future = job
        del job
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which raises it
                future.set_exception(exc)
        del fn, future  # hold nothing while idle, so the `DiLoCo` can be collected (and stop this thread)


def _stop(jobs: queue.SimpleQueue, thread: threading.Thread, limit: float) -> None:
    """Stop the exchange thread and wait (at most ``limit`` s) for the exchange it runs: a thread still
    inside a collective when the interpreter exits would abort the process."""
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join(limit)


def _group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    """The collective timeout of ``group`` (``init_process_group(timeout=...)``); torch's default if unknown."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return dist.default_pg_timeout


def _exchange_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group of ``group``'s ranks, in the same rank order, backend and timeout: the exchange
    thread's own, so its collectives never interleave with the training thread's (buffers, the user's).

    Every rank of ``group`` must call this in the same order (as it builds its `DiLoCo` objects); for a
    group of every rank, every rank of the world does."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    order = {} if ranks == sorted(ranks) else {"sort_ranks": False}  # group rank r stays rank r
    return dist.new_group(ranks, timeout=_group_timeout(group), backend=dist.get_backend(group),
                          use_local_synchronization=len(ranks) < dist.get_world_size(),
                          group_desc="fedcomp_diloco_exchange", **order)


class DiLoCo:
    """Outer synchronisation every ``sync_every`` inner steps, the pseudo-gradient sent compressed.

    Call [`step`][fedcomp.distributed.DiLoCo.step] once after every ``inner_optimizer.step()``. Every ``sync_every``
    calls (per fragment, see ``fragments``) it

    1. forms the pseudo-gradient ``start - now`` of the fragment's parameters as one flat fp32
       vector (``start``: the parameters after the previous outer step);
    2. checks it is finite on every rank (one small allreduce, so every rank raises together);
    3. averages it over the process group with `fedcomp.distributed.exchange.average`: the
       codec (with error feedback: ``x + residual`` is sent, the residual keeps what the payload
       did not carry), an allreduce for ``none``/``fp16`` without error feedback, otherwise an
       all-gather of payloads decoded in rank order: the mean is bit-identical on every rank;
    4. sets the mean as the ``.grad`` of the outer copies (``start``) and runs the outer optimizer;
       the result is the new ``start`` and is copied into the model's parameters (merged with them
       when ``mixing > 0``);
    5. at the end of each interval (inner steps ``t`` with ``t % H == 0``), makes the buffers
       identical, uncompressed: rank 0's by default (as DDP's ``broadcast_buffers``), or BatchNorm's
       running statistics averaged (``buffers="mean"``).

    **Overlap** (``overlap_steps = tau > 0``). Step 1 runs at the fragment's sync step; steps 2-3
    (the finiteness check, the encoding with error feedback, the collectives, the decoding) then run
    on a background thread while the rank takes its next tau inner steps, and step 4 runs in the
    [`step`][fedcomp.distributed.DiLoCo.step] call of inner step ``t + tau`` (Douillard et al. 2025,
    Streaming DiLoCo with overlapping communication). The thread owns a process group of its own
    (``dist.new_group`` over the same ranks, with the same backend and timeout), built at
    construction, and runs the exchanges one at a time in the order they began: every rank begins
    the same exchanges in the same order, so the collectives match and the mean is still
    bit-identical on every rank; the training thread's collectives (buffers, and any of the user's
    on ``process_group``) never interleave with them. While an exchange is in flight its
    fragment's parameters keep training; when it lands, the new outer copy ``g`` (identical on
    every rank) and the rank's local fragment ``x`` (tau steps further than the pseudo-gradient
    sent) are merged as ``x <- mixing * x + (1 - mixing) * g``:

    - ``mixing = 0`` (the default): ``x <- g``, the local fragment is replaced. Why the default:
      every rank's fragment is then bit-identical again, as without overlap, so one rank's model
      (evaluated, saved) is every rank's, and the next pseudo-gradient is counted from a point
      every rank shares. The price: what each rank's last tau inner steps changed in that fragment
      is dropped (the inner optimizer's state keeps what they taught it), about tau / H of the
      fragment's local progress per outer step.
    - ``0 < mixing < 1`` keeps that share of the rank's local fragment (the paper's mixing factor):
      the ranks' parameters then differ by ``mixing`` times their local drift; the outer copies
      stay bit-identical, and the local part kept enters the rank's next pseudo-gradient.

    Step 5 stays on the training thread, a blocking collective (buffers are small). Overlap costs,
    per exchange in flight, one fragment-sized fp32 copy (the pseudo-gradient sent), and one
    thread and one process group per `DiLoCo`.

    With overlap, a failure of the exchange (a rank that died, a collective timeout, a NaN/Inf
    pseudo-gradient, a payload that does not decode) is raised by the ``step()`` call where the
    update would have landed, on every rank alike; the training thread never waits longer than
    three collective timeouts for one exchange. [`state_dict`][fedcomp.distributed.DiLoCo.state_dict]
    waits for the exchanges in flight to finish and saves their means without applying them: they
    land at their own step after [`load_state_dict`][fedcomp.distributed.DiLoCo.load_state_dict],
    so a resumed run repeats the uninterrupted one bit for bit. At the end of training call
    [`flush`][fedcomp.distributed.DiLoCo.flush] (on every rank, after the same inner step) to apply
    the updates still in flight.

    At construction rank 0's parameters and buffers are broadcast to every rank (as DDP does).
    The outer copies are fp32 (fp64 for fp64 parameters), on the parameters' device: one model-sized
    copy, plus the outer optimizer's state (one more for momentum). Only parameters with
    ``requires_grad`` are synchronised; frozen ones keep rank 0's values.

    Parameters
    ----------
    model : torch.nn.Module
        The model each rank trains; at least one floating-point parameter that requires grad.
    inner_optimizer : torch.optim.Optimizer
        The rank's own optimizer over (some of) ``model``'s parameters. It is not stepped or reset
        here: its state (e.g. AdamW's moments) carries across outer steps, as in DiLoCo.
    compressor : str
        Codec of the pseudo-gradient, one of ``fedcomp.compression.available_compressors()`` except
        the per-tensor (low-rank) ones; default ``"none"`` (fp32, DiLoCo as published).
    sync_every : int
        H, inner steps between two outer steps of a fragment, >= 1. Default 50; the paper uses
        500 for 150M-parameter models: larger H sends less but drifts further.
    error_feedback : bool, optional
        Keep a residual per fragment (Karimireddy et al. 2019). Default None: on for every lossy
        codec (all but the dense casts ``none``, ``fp16``, ``bf16``); biased codecs (sign, STC,
        top-k, PowerSGD) do not train without it, and for the unbiased int8/QSGD it costs one
        model-sized fp32 buffer; off for QSGD with too few levels for its buckets, with which it diverges
        (`fedcomp.compression.Compressor.error_feedback_refusal`). False with a codec that requires it is
        refused, and so is True with one with which it diverges.
    outer_optimizer : callable or torch.optim.Optimizer, optional
        A factory ``params -> Optimizer`` called with the outer copies (e.g.
        ``functools.partial(torch.optim.SGD, lr=1.0)``), or an optimizer built over ``model``'s
        parameters that has not stepped yet (its parameters are replaced by the outer copies).
        Default `default_outer_optimizer` (SGD, lr 0.7, Nesterov momentum 0.9).
    fragments : int
        F, contiguous fragments of the parameters synchronised at staggered inner steps
        (Streaming DiLoCo), 1 <= F <= min(H, number of synchronised tensors). Default 1.
    overlap_steps : int
        tau, inner steps between the start of a fragment's exchange and its outer update,
        0 <= tau < H (a fragment's update lands before its next exchange begins). Default 0: each
        exchange blocks its ``step()`` call. Choose tau so that tau inner steps take longer than one
        exchange on your link: then no ``step()`` waits for the network.
    mixing : float
        The share of the rank's local fragment kept when the fragment's outer update lands (see
        above; with ``overlap_steps = 0`` the local fragment is the one just sent), 0 <= mixing < 1.
        Default 0: the local fragment is replaced.
    process_group : torch.distributed.ProcessGroup, optional
        Default: the default group (``init_process_group`` must have run).
    residual_dtype : {"fp32", "fp16"}
        Storage of the error-feedback residual. Default "fp32".
    buffers : {"broadcast", "mean"}
        How the persistent buffers (those in ``model.state_dict()``) become identical at the end of
        each interval: ``"broadcast"`` (default) sends rank 0's (exact; what DDP does before every
        forward); ``"mean"`` averages the floating-point ones in fp32 (BatchNorm's running
        statistics over every rank's data) and takes the maximum of integer/bool ones
        (``num_batches_tracked``). Non-persistent buffers (constants such as attention masks) are
        sent once, at construction, and never again.
    **codec_options
        The codec's parameters (``density``, ``levels``, ``block_size``, ``rank``, ...; see
        [`fedcomp.compression.get_compressor`][]). ``seed`` for a stochastic codec seeds every
        exchange with a seed derived from it, the rank, the fragment and the outer step (runs and
        resumed runs reproduce); without it the codec draws from the OS.

    Attributes
    ----------
    inner_steps : int
        Calls of [`step`][fedcomp.distributed.DiLoCo.step] so far.
    outer_steps : int
        Fragment synchronisations so far (with F = 1: outer steps).
    bytes : ByteCount
        ``sent``: bytes this rank handed to collectives for the pseudo-gradients, the finiteness
        check and the buffers (the construction broadcast not included); ``dense``: what DDP's fp32
        allreduce of the gradients would have sent, 4 bytes x synchronised parameters x inner steps.
    sync_seconds : float
        Wall-clock seconds the training thread spent inside synchronisations: with ``overlap_steps =
        0`` the exchanges and outer steps; with overlap, forming the pseudo-gradients, waiting for
        exchanges not finished by their landing step, the outer steps and the buffers (the
        exchanges' time on the background thread is not counted).
    params : list of torch.nn.Parameter
        The synchronised parameters (the model's that require grad), in model order.
    groups : list of list of int
        The fragments: indices into `params`, contiguous.
    synced : list of int
        The fragments whose outer update the last [`step`][fedcomp.distributed.DiLoCo.step] (or
        [`flush`][fedcomp.distributed.DiLoCo.flush]) applied (empty if none).
    started : list of int
        The fragments whose exchange the last [`step`][fedcomp.distributed.DiLoCo.step] began
        (with ``overlap_steps = 0`` the same as ``synced``).

    Raises
    ------
    TypeError
        ``model``, ``inner_optimizer``, ``compressor``, ``outer_optimizer``, ``error_feedback`` or
        ``process_group`` of the wrong type.
    ValueError
        A setting out of range, naming it: ``sync_every``, ``fragments``, ``overlap_steps``, ``mixing``,
        ``compressor`` and its options, ``error_feedback``, ``residual_dtype``, ``buffers``,
        ``inner_optimizer`` (holds parameters that are not the model's), ``outer_optimizer`` (has
        state, or parameters not the model's).
    RuntimeError
        ``torch.distributed`` is not initialised.

    Examples
    --------
    >>> outer = DiLoCo(model, inner, compressor="int8", sync_every=50)  # doctest: +SKIP
    >>> for x, y in batches:  # doctest: +SKIP
    ...     loss_fn(model(x), y).backward(); inner.step(); inner.zero_grad()
    ...     outer.step()
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 compressor: str = "none", sync_every: int = 50, error_feedback: bool | None = None,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | torch.optim.Optimizer
                 | None = None, fragments: int = 1, overlap_steps: int = 0, mixing: float = 0.0,
                 process_group: dist.ProcessGroup | None = None, residual_dtype: str = "fp32",
                 buffers: str = "broadcast", **codec_options: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        self.sync_every = check_number(sync_every, "sync_every", lo=1, integer=True, exact_type=True)
        self.model, self.inner_optimizer = model, inner_optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params or any(not p.is_floating_point() for p in self.params):
            raise ValueError("model must have floating-point parameters that require grad (none to synchronise)")
        owned = {id(p) for p in model.parameters()}
        if any(id(p) not in owned for g in inner_optimizer.param_groups for p in g["params"]):
            raise ValueError("inner_optimizer holds parameters that are not the model's")
        self.fragments = check_number(fragments, "fragments", lo=1, hi=min(self.sync_every, len(self.params)),
                                      integer=True, exact_type=True)
        self.overlap_steps = check_number(overlap_steps, "overlap_steps", lo=0, integer=True, exact_type=True)
        if self.overlap_steps >= self.sync_every:
            raise ValueError(f"overlap_steps must be < sync_every ({self.sync_every}): a fragment's update must "
                             f"land before its next exchange begins, got {overlap_steps!r}")
        self.mixing = check_number(mixing, "mixing", lo=0.0, hi=1.0, hi_open=True)
        self.codec_name, self.codec_options = self._check_codec(compressor, codec_options)
        self.error_feedback = self._check_error_feedback(error_feedback)
        if residual_dtype not in ("fp32", "fp16"):
            raise ValueError(f"residual_dtype must be 'fp32' or 'fp16', got {residual_dtype!r}")
        self.residual_dtype = residual_dtype
        if buffers not in ("broadcast", "mean"):
            raise ValueError(f"buffers must be 'broadcast' or 'mean', got {buffers!r}")
        self.buffer_rule = buffers
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                            f"got {type(process_group).__name__}")
        self._check_outer_optimizer(outer_optimizer)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DiLoCo needs torch.distributed: call torch.distributed.init_process_group(...) "
                               "first (torchrun sets the environment it reads)")
        self.group = process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.inner_steps, self.outer_steps, self.sync_seconds = 0, 0, 0.0
        self.bytes = ByteCount()
        self._fragment_syncs = [0] * self.fragments
        self.synced: list[int] = []
        self.started: list[int] = []
        self._broadcast_from_first()
        self.starts = [p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True) for p in self.params]
        self.groups = split_fragments([p.numel() for p in self.params], self.fragments)
        self.outer_optimizer = self._build_outer_optimizer(outer_optimizer)
        self.feedback = [self._new_feedback() for _ in range(self.fragments)]
        self._in_flight: deque[_Exchange] = deque()
        # the longest the training thread waits for one exchange: its three collectives, each bounded
        self._wait_limit = 3 * _group_timeout(self.group).total_seconds() + 30.0
        if self.overlap_steps:
            self._exchange_group = _exchange_group(self.group)
            self._jobs: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(self._jobs,), name="fedcomp-diloco-exchange", daemon=True)
            thread.start()
            # the thread ends with this object, or at the interpreter's exit
            weakref.finalize(self, _stop, self._jobs, thread, self._wait_limit)

    # -- construction ------------------------------------------------------------------------------

    @staticmethod
    def _check_codec(compressor: Any, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """The codec's name and options, built once to validate them (``compressor: ...`` errors)."""
        if not isinstance(compressor, str):
            raise TypeError(f"compressor must be a codec name (str), got {type(compressor).__name__}")
        try:
            codec = get_compressor(compressor, **options)
        except ValueError as exc:
            raise ValueError(f"compressor: {exc}") from exc
        if codec.per_tensor_only:
            raise ValueError(f"compressor {compressor!r} compresses one matrix per tensor; DiLoCo sends each fragment "
                             "as one flat vector, which it would send uncompressed: choose a codec of "
                             "fedcomp.compression.codecs_with(per_tensor_only=False)")
        return compressor, dict(options)

    def _check_error_feedback(self, error_feedback: Any) -> bool:
        """Resolve ``error_feedback`` (None: on for every lossy codec)."""
        codec = get_compressor(self.codec_name, **self.codec_options)
        if error_feedback is None:
            error_feedback = error_feedback_default(codec)
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        if not error_feedback and codec.requires_error_feedback:
            raise ValueError(f"error_feedback=False with compressor {self.codec_name!r}: "
                             f"{codec.requires_error_feedback}")
        if error_feedback:
            check_error_feedback(codec, "error_feedback")
        return error_feedback

    def _check_outer_optimizer(self, outer_optimizer: Any) -> None:
        if outer_optimizer is None or (callable(outer_optimizer)
                                       and not isinstance(outer_optimizer, torch.optim.Optimizer)):
            return
        if not isinstance(outer_optimizer, torch.optim.Optimizer):
            raise TypeError("outer_optimizer must be a factory (params -> torch.optim.Optimizer), an optimizer "
                            f"over the model's parameters, or None; got {type(outer_optimizer).__name__}")
        if outer_optimizer.state:
            raise ValueError("outer_optimizer has state already (it stepped): pass a fresh one or a factory")
        mine = {id(p) for p in self.params}
        if any(id(p) not in mine for g in outer_optimizer.param_groups for p in g["params"]):
            raise ValueError("outer_optimizer holds parameters that are not the model's trainable parameters")

    def _build_outer_optimizer(self, outer_optimizer: Any) -> torch.optim.Optimizer:
        """The outer optimizer over the outer copies ``self.starts``."""
        if isinstance(outer_optimizer, torch.optim.Optimizer):
            copy_of = {id(p): s for p, s in zip(self.params, self.starts)}
            for g in outer_optimizer.param_groups:
                g["params"] = [copy_of[id(p)] for p in g["params"]]
            return outer_optimizer
        opt = (outer_optimizer or default_outer_optimizer)(self.starts)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
        return opt

    def _new_feedback(self) -> ErrorFeedback | None:
        if not self.error_feedback:
            return None
        return ErrorFeedback(get_compressor(self.codec_name, **self.codec_options), residual_dtype=self.residual_dtype)

    @torch.no_grad()
    def _broadcast_from_first(self) -> None:
        """Rank 0's parameters and buffers on every rank (as ``DistributedDataParallel`` starts)."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.numel():
                dist.broadcast(t.data, src=src, group=self.group)

    # -- the loop ----------------------------------------------------------------------------------

    def step(self) -> bool:
        """Count one inner step; begin the exchanges of the fragments due at this step, apply the
        outer updates due at this step.

        With ``overlap_steps = 0`` a fragment's exchange and outer update both happen in the call of
        its sync step; with ``overlap_steps = tau`` the exchange begins there and runs in the
        background, and its outer update is applied in the call tau inner steps later.

        Returns
        -------
        bool
            True if an outer update was applied to a fragment in this call (with F = 1 and tau = 0:
            an outer step ran). `synced` lists those fragments, `started` the fragments whose
            exchange began.

        Raises
        ------
        fedcomp.distributed.CompressionError
            A ValueError: the pseudo-gradient holds NaN/Inf on some rank (every rank raises; the
            message names the codec, the fragment and the ranks).
        fedcomp.compression.PayloadError
            A rank sent a payload that does not decode.
        RuntimeError
            A collective failed (a rank died or timed out: ``init_process_group(timeout=...)``);
            with overlap, also an exchange still unfinished after three collective timeouts. The
            message names the fragment and the inner step its exchange began.
        """
        self.inner_steps += 1
        self.bytes.dense += 4 * sum(p.numel() for p in self.params)
        due = [f for f in range(self.fragments) if self.inner_steps % self.sync_every == self._offset(f)]
        landing = sum(1 for ex in self._in_flight if ex.lands == self.inner_steps)
        self.started = due
        if not due and not landing:
            self.synced = []
            return False
        began = time.perf_counter()
        if self.overlap_steps:
            self.synced = [self._land(self._in_flight.popleft()) for _ in range(landing)]  # in the order begun
            for f in due:
                self._begin(f)
        else:
            for f in due:
                codec, feedback = self._codec(f)
                self._apply(f, *self._exchange(f, self.inner_steps, self._pseudo_gradient(f), codec, feedback,
                                               self.group))
            self.synced = due
        if self.inner_steps % self.sync_every == 0:
            self._sync_buffers()
        self.sync_seconds += time.perf_counter() - began
        return bool(self.synced)

    def flush(self) -> bool:
        """Apply now the outer updates of every exchange still in flight (``overlap_steps > 0``).

        Call it at the end of training, before evaluating or saving the final model, on every
        rank after the same inner step (the updates are applied early, so a rank that flushes
        alone leaves the others). It runs no collective: it waits for the background exchanges.
        Training may go on afterwards; the flushed updates do not land again.

        Returns
        -------
        bool
            True if an update was applied (`synced` lists the fragments).

        Raises
        ------
        fedcomp.distributed.CompressionError, fedcomp.compression.PayloadError, RuntimeError
            As [`step`][fedcomp.distributed.DiLoCo.step], for the exchanges in flight.
        """
        began = time.perf_counter()
        self.synced = [self._land(self._in_flight.popleft()) for _ in range(len(self._in_flight))]
        self.started = []
        self.sync_seconds += time.perf_counter() - began
        return bool(self.synced)

    def _offset(self, fragment: int) -> int:
        """Fragment ``fragment`` synchronises at the inner steps ``t`` with ``t % H == offset``."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every

    @torch.no_grad()
    def _pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """``start - now`` of the fragment's parameters: a new flat fp32 tensor on the parameters' device."""
        idx = self.groups[fragment]
        device = self.params[idx[0]].device
        return torch.cat([(self.starts[i] - self.params[i].detach()).reshape(-1).to(device, torch.float32)
                          for i in idx])

    @torch.no_grad()
    def _exchange(self, fragment: int, step: int, delta: torch.Tensor, codec: Compressor,
                  feedback: ErrorFeedback | None, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int]:
        """The finiteness check and the average of ``delta`` over ``group``: ``(mean, bytes sent)``.
        Runs on the training thread (``overlap_steps = 0``) or the exchange thread; touches no state but
        the fragment's error feedback, which nothing else touches while its exchange is in flight."""
        sent = self._check_finite(delta, fragment, step, group)
        exchanged = ByteCount()
        mean = average(delta, codec, feedback, group, exchanged)
        return mean, sent + exchanged.sent

    def _begin(self, fragment: int) -> None:
        """Form the fragment's pseudo-gradient and queue its exchange on the exchange thread."""
        delta = self._pseudo_gradient(fragment)
        codec, feedback = self._codec(fragment)
        ready = None
        if delta.is_cuda:  # the exchange thread's stream starts after the pseudo-gradient is computed
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(delta.device))
        job = functools.partial(self._background, fragment, self.inner_steps, delta, codec, feedback, ready)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((job, future))
        self._in_flight.append(_Exchange(fragment, self.inner_steps, self.inner_steps + self.overlap_steps, future))

    def _background(self, fragment: int, step: int, delta: torch.Tensor, codec: Compressor,
                    feedback: ErrorFeedback | None, ready: Any) -> tuple[torch.Tensor, int]:
        """One exchange on the exchange thread, over its own process group."""
        if ready is None:
            return self._exchange(fragment, step, delta, codec, feedback, self._exchange_group)
        with torch.cuda.device(delta.device):
            stream = torch.cuda.current_stream(delta.device)
            stream.wait_event(ready)
            out = self._exchange(fragment, step, delta, codec, feedback, self._exchange_group)
            stream.synchronize()  # the mean is complete before the training thread reads it
        return out

    def _result(self, ex: _Exchange) -> tuple[torch.Tensor, int]:
        """The exchange's ``(mean, bytes sent)``, waited for at most `_wait_limit` seconds; its error, raised
        with the fragment and the inner step it began."""
        where = f"DiLoCo: the exchange of fragment {ex.fragment} begun at inner step {ex.started}"
        try:
            return ex.future.result(timeout=self._wait_limit)
        except TimeoutError:
            if ex.future.done():  # the exchange itself timed out
                raise
            raise RuntimeError(f"{where} has not finished after {self._wait_limit:.0f} s (three collective "
                               "timeouts of the process group): a peer died or stalls") from None
        except ValueError as exc:  # CompressionError, PayloadError: the same type on every rank
            exc.add_note(f"{where} (overlap_steps={self.overlap_steps}) raised this")
            raise
        except Exception as exc:  # noqa: BLE001 - a collective failed: said with where it happened
            raise RuntimeError(f"{where} failed (a peer died or timed out?): {type(exc).__name__}: {exc}") from exc

    def _land(self, ex: _Exchange) -> int:
        """Apply the outer update of a finished exchange; the fragment."""
        mean, sent = self._result(ex)
        self._apply(ex.fragment, mean, sent)
        return ex.fragment

    @torch.no_grad()
    def _apply(self, fragment: int, mean: torch.Tensor, sent: int) -> None:
        """The fragment's outer step with ``mean`` as the outer copies' gradient; the parameters then
        take the new outer copies (``mixing = 0``) or ``mixing * local + (1 - mixing) * outer``."""
        idx = self.groups[fragment]
        self.bytes.sent += sent
        offset = 0
        for i in idx:
            s = self.starts[i]
            s.grad = mean[offset: offset + s.numel()].view_as(s).to(s.device, s.dtype)
            offset += s.numel()
        self.outer_optimizer.step()
        for i in idx:
            self.starts[i].grad = None
            if self.mixing:
                self.params[i].mul_(self.mixing).add_(self.starts[i].to(self.params[i].dtype), alpha=1 - self.mixing)
            else:
                self.params[i].copy_(self.starts[i])
        self._fragment_syncs[fragment] += 1
        self.outer_steps += 1

    def _check_finite(self, delta: torch.Tensor, fragment: int, step: int, group: dist.ProcessGroup | None) -> int:
        """Every rank learns which ranks' pseudo-gradients are not finite, and all raise together; the bytes sent."""
        flags = torch.zeros(self.world_size, dtype=torch.float32, device=delta.device)
        flags[self.rank] = 0.0 if bool(torch.isfinite(delta).all()) else 1.0
        dist.all_reduce(flags, group=group)
        bad = [r for r in range(self.world_size) if flags[r] > 0]
        if bad:
            raise CompressionError(f"DiLoCo (compressor {self.codec_name!r}): the pseudo-gradient of fragment "
                                   f"{fragment} holds NaN/Inf on rank(s) {bad} at inner step {step}; the "
                                   "inner steps diverged (lower the inner learning rate or clip gradients)", bad)
        return flags.numel() * 4

    def _codec(self, fragment: int) -> tuple[Compressor, ErrorFeedback | None]:
        """The codec of this exchange: a seeded codec with a given ``seed`` gets one derived from it,
        the rank, the fragment and the fragment's outer step."""
        feedback = self.feedback[fragment]
        base = self.codec_options.get("seed")
        codec = feedback.compressor if feedback is not None else None
        if base is not None:
            seed = int(np.random.SeedSequence([int(base), self.rank, fragment,
                                               self._fragment_syncs[fragment]]).generate_state(1)[0])
            fresh = get_compressor(self.codec_name, **{**self.codec_options, "seed": seed})
            if codec is not None:
                fresh.set_state(codec.get_state())
            codec = fresh
        elif codec is None:
            codec = get_compressor(self.codec_name, **self.codec_options)
        if feedback is not None:
            feedback.compressor = codec
        return codec, feedback

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        """The persistent buffers (those in the model's ``state_dict``) made identical: ``"broadcast"``:
        rank 0's; ``"mean"``: floating-point ones averaged (fp32 allreduce), integer/bool ones set to
        their maximum. Non-persistent buffers (constants such as attention masks) are left alone."""
        persistent = {id(v) for v in self.model.state_dict(keep_vars=True).values()}
        buffers = [b for b in self.model.buffers() if b.numel() and id(b) in persistent]
        if self.buffer_rule == "broadcast":
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for b in buffers:
                dist.broadcast(b.data, src=src, group=self.group)
                self.bytes.sent += b.numel() * b.element_size()
            return
        floats = [b for b in buffers if b.is_floating_point()]
        if floats:
            flat = torch.cat([b.detach().reshape(-1).to(torch.float32) for b in floats])
            exchanged = ByteCount()
            mean = average(flat, get_compressor("none"), None, self.group, exchanged)
            self.bytes.sent += exchanged.sent
            offset = 0
            for b in floats:
                b.copy_(mean[offset: offset + b.numel()].view_as(b))
                offset += b.numel()
        for b in buffers:
            if not b.is_floating_point():
                t = b.detach().to(torch.int64) if b.dtype == torch.bool else b.detach().clone()
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
                self.bytes.sent += t.numel() * t.element_size()
                b.copy_(t.to(b.dtype))

    # -- checkpoints -------------------------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        return {"compressor": self.codec_name, "codec_options": dict(self.codec_options),
                "sync_every": self.sync_every, "fragments": self.fragments,
                "overlap_steps": self.overlap_steps, "mixing": self.mixing,
                "error_feedback": self.error_feedback, "buffers": self.buffer_rule,
                "world_size": self.world_size, "rank": self.rank}

    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state, for ``torch.save`` (loadable with ``weights_only=True``).

        Each rank saves its own: the residuals differ per rank. Save the model and the inner
        optimizer alongside (their own ``state_dict()``), after the same inner step on every rank.
        With exchanges in flight (``overlap_steps > 0``) it first waits for them to finish (no
        collective of its own: the exchange thread completes them) and saves their means
        unapplied, with the step each lands at; the run goes on unchanged.

        Returns
        -------
        dict
            ``version``; ``settings`` (codec and options, H, F, overlap steps, mixing, error feedback,
            world size, rank); ``inner_steps``, ``outer_steps``, ``fragment_syncs``; ``starts`` (the
            outer copies, CPU tensors); ``outer_optimizer`` (its ``state_dict()``: momentum);
            ``feedback`` (per fragment the error-feedback state as CPU tensors: ``residual``, codec
            memory; ``{}`` without); ``pending`` (per exchange in flight: ``fragment``, ``started``,
            ``lands``, ``mean`` (fp32 CPU tensor), ``sent`` (bytes)); ``bytes`` (``sent``, ``dense``);
            ``sync_seconds``.

        Raises
        ------
        fedcomp.distributed.CompressionError, fedcomp.compression.PayloadError, RuntimeError
            As [`step`][fedcomp.distributed.DiLoCo.step], for an exchange in flight that failed.
        """
        pending = []
        for ex in self._in_flight:  # first: the exchanges update the residuals
            mean, sent = self._result(ex)
            pending.append({"fragment": ex.fragment, "started": ex.started, "lands": ex.lands,
                            "mean": mean.detach().to("cpu", torch.float32, copy=True), "sent": int(sent)})
        return {
            "version": STATE_VERSION,
            "settings": self._settings(),
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "fragment_syncs": list(self._fragment_syncs),
            "starts": [s.detach().cpu().clone() for s in self.starts],
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "feedback": [{} if ef is None else {k: torch.from_numpy(np.array(v, copy=True))
                                                 for k, v in ef.get_state().items()} for ef in self.feedback],
            "pending": pending,
            "bytes": {"sent": self.bytes.sent, "dense": self.bytes.dense},
            "sync_seconds": self.sync_seconds,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what [`state_dict`][fedcomp.distributed.DiLoCo.state_dict] returned on this rank (after loading the
        model's own), into a DiLoCo with no exchange in flight (a fresh one). The saved exchanges in
        flight land at their own inner step.

        Raises
        ------
        ValueError
            A different layout version, codec, options, H, F, overlap steps, mixing, error-feedback
            setting, world size or rank (naming the setting), outer copies of other shapes, or saved
            exchanges that do not fit the fragments.
        RuntimeError
            This DiLoCo has exchanges in flight (``flush()`` them, or load into a fresh one).
        """
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"DiLoCo state version {state.get('version')!r}, expected {STATE_VERSION} (or 1)")
        if self._in_flight:
            raise RuntimeError("DiLoCo.load_state_dict: this DiLoCo has exchanges in flight; call flush() first or "
                               "load into a fresh DiLoCo")
        saved, mine = {**_V1_SETTINGS, **state["settings"]}, self._settings()
        for key in mine:
            if saved.get(key) != mine[key]:
                raise ValueError(f"DiLoCo checkpoint has {key}={saved.get(key)!r}, this run {key}={mine[key]!r}")
        starts = state["starts"]
        if [tuple(s.shape) for s in starts] != [tuple(s.shape) for s in self.starts]:
            raise ValueError("DiLoCo checkpoint's outer copies do not match the model's parameters")
        pending = list(state.get("pending", []))
        for item in pending:
            f = int(item["fragment"])
            size = sum(self.starts[i].numel() for i in self.groups[f]) if 0 <= f < self.fragments else -1
            if (item["mean"].numel() != size or int(item["lands"]) - int(item["started"]) != self.overlap_steps
                    or int(item["lands"]) <= int(state["inner_steps"])):
                raise ValueError(f"DiLoCo checkpoint's exchange in flight of fragment {item['fragment']!r} does not "
                                 "fit this run's fragments and overlap_steps")
        with torch.no_grad():
            for s, saved_s in zip(self.starts, starts):
                s.copy_(saved_s)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for ef, st in zip(self.feedback, state["feedback"]):
            if ef is not None:
                ef.set_state({k: v.numpy() for k, v in st.items()})
        for item in pending:
            f = int(item["fragment"])
            future: concurrent.futures.Future = concurrent.futures.Future()
            mean = item["mean"].to(self.params[self.groups[f][0]].device, torch.float32)
            future.set_result((mean, int(item["sent"])))
            self._in_flight.append(_Exchange(f, int(item["started"]), int(item["lands"]), future))
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])
        self._fragment_syncs = [int(n) for n in state["fragment_syncs"]]
        self.bytes = ByteCount(int(state["bytes"]["sent"]), int(state["bytes"]["dense"]))
        self.sync_seconds = float(state["sync_seconds"])
