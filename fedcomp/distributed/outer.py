"""DiLoCo: compressed outer synchronisation of data-parallel workers every ``sync_every`` inner steps.

Each rank trains its own copy of the model with its own inner optimizer; every H inner steps the
ranks exchange the *pseudo-gradient* ``start - now`` (how far each moved since the last outer
step), compressed with any fedcomp codec and error feedback, average it, and an outer optimizer
(SGD with Nesterov momentum by default) applies the mean to the parameters at the start of the
interval. Ranks' parameters are bit-identical after every outer step.

With ``fragments = F > 1`` the parameters are split into F contiguous fragments, each synchronised
every H inner steps, fragment f at inner steps ``t`` with ``t % H == ((f + 1) * H // F) % H``: the
traffic of one outer step is spread over the interval (Streaming DiLoCo). Communication is not
overlapped with the following inner steps: each fragment's exchange blocks its ``step()`` call.

Sources: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023 (pseudo-gradient, outer SGD with Nesterov momentum, lr 0.7, momentum 0.9); Douillard et al.,
"Streaming DiLoCo with overlapping communication", 2025 (fragments); Sarfi et al., "SparseLoCo:
Communication-Efficient LLM Training", 2025 (top-k pseudo-gradients with error feedback);
Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes", ICML 2019.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fedcomp.compression import Compressor, ErrorFeedback, get_compressor
from fedcomp.distributed.exchange import ByteCount, CompressionError, average
from fedcomp.util.validate import check_number

#: The outer optimizer of the DiLoCo paper (Douillard et al. 2023, Sec. 3): SGD, Nesterov momentum.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
#: Version of the `DiLoCo.state_dict` layout.
STATE_VERSION = 1


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
       the result is the new ``start`` and is copied into the model's parameters;
    5. after the last fragment of an interval, makes the buffers identical, uncompressed: rank 0's
       by default (as DDP's ``broadcast_buffers``), or BatchNorm's running statistics averaged
       (``buffers="mean"``).

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
        model-sized fp32 buffer. False with a codec that requires it is refused.
    outer_optimizer : callable or torch.optim.Optimizer, optional
        A factory ``params -> Optimizer`` called with the outer copies (e.g.
        ``functools.partial(torch.optim.SGD, lr=1.0)``), or an optimizer built over ``model``'s
        parameters that has not stepped yet (its parameters are replaced by the outer copies).
        Default `default_outer_optimizer` (SGD, lr 0.7, Nesterov momentum 0.9).
    fragments : int
        F, contiguous fragments of the parameters synchronised at staggered inner steps
        (Streaming DiLoCo), 1 <= F <= min(H, number of synchronised tensors). Default 1.
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
        Wall-clock seconds spent inside synchronisations (exchange and outer step).
    params : list of torch.nn.Parameter
        The synchronised parameters (the model's that require grad), in model order.
    groups : list of list of int
        The fragments: indices into `params`, contiguous.
    synced : list of int
        The fragments the last [`step`][fedcomp.distributed.DiLoCo.step] synchronised (empty if none).

    Raises
    ------
    TypeError
        ``model``, ``inner_optimizer``, ``compressor``, ``outer_optimizer``, ``error_feedback`` or
        ``process_group`` of the wrong type.
    ValueError
        A setting out of range, naming it: ``sync_every``, ``fragments``, ``compressor`` and its
        options, ``error_feedback``, ``residual_dtype``, ``buffers``, ``inner_optimizer`` (holds parameters
        that are not the model's), ``outer_optimizer`` (has state, or parameters not the model's).
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
                 | None = None, fragments: int = 1, process_group: dist.ProcessGroup | None = None,
                 residual_dtype: str = "fp32", buffers: str = "broadcast", **codec_options: Any) -> None:
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
        self._broadcast_from_first()
        self.starts = [p.detach().to(torch.promote_types(p.dtype, torch.float32), copy=True) for p in self.params]
        self.groups = split_fragments([p.numel() for p in self.params], self.fragments)
        self.outer_optimizer = self._build_outer_optimizer(outer_optimizer)
        self.feedback = [self._new_feedback() for _ in range(self.fragments)]

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
        cls = type(get_compressor(self.codec_name, **self.codec_options))
        if error_feedback is None:
            return not cls.small_tensor
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True, False or None, got {error_feedback!r}")
        if not error_feedback and cls.requires_error_feedback:
            raise ValueError(f"error_feedback=False with compressor {self.codec_name!r}: "
                             f"{cls.requires_error_feedback}")
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
        """Count one inner step; synchronise the fragments due at this step.

        Returns
        -------
        bool
            True if a fragment was synchronised in this call (with F = 1: an outer step ran).

        Raises
        ------
        fedcomp.distributed.CompressionError
            A ValueError: the pseudo-gradient holds NaN/Inf on some rank (every rank raises; the
            message names the codec, the fragment and the ranks).
        fedcomp.compression.PayloadError
            A rank sent a payload that does not decode.
        RuntimeError
            A collective failed (a rank died or timed out: ``init_process_group(timeout=...)``).
        """
        self.inner_steps += 1
        self.bytes.dense += 4 * sum(p.numel() for p in self.params)
        self.synced = [f for f in range(self.fragments) if self.inner_steps % self.sync_every == self._offset(f)]
        if not self.synced:
            return False
        began = time.perf_counter()
        for f in self.synced:
            self._sync(f)
        if self.inner_steps % self.sync_every == 0:
            self._sync_buffers()
        self.sync_seconds += time.perf_counter() - began
        return True

    def _offset(self, fragment: int) -> int:
        """Fragment ``fragment`` synchronises at the inner steps ``t`` with ``t % H == offset``."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every

    @torch.no_grad()
    def _sync(self, fragment: int) -> None:
        """One outer step of one fragment: exchange its pseudo-gradient, step the outer optimizer."""
        idx = self.groups[fragment]
        device = self.params[idx[0]].device
        delta = torch.cat([(self.starts[i] - self.params[i].detach()).reshape(-1).to(device, torch.float32)
                           for i in idx])
        self._check_finite(delta, fragment)
        codec, feedback = self._codec(fragment)
        exchanged = ByteCount()
        mean = average(delta, codec, feedback, self.group, exchanged)
        self.bytes.sent += exchanged.sent
        offset = 0
        for i in idx:
            s = self.starts[i]
            s.grad = mean[offset: offset + s.numel()].view_as(s).to(s.device, s.dtype)
            offset += s.numel()
        self.outer_optimizer.step()
        for i in idx:
            self.starts[i].grad = None
            self.params[i].copy_(self.starts[i])
        self._fragment_syncs[fragment] += 1
        self.outer_steps += 1

    def _check_finite(self, delta: torch.Tensor, fragment: int) -> None:
        """Every rank learns which ranks' pseudo-gradients are not finite, and all raise together."""
        flags = torch.zeros(self.world_size, dtype=torch.float32, device=delta.device)
        flags[self.rank] = 0.0 if bool(torch.isfinite(delta).all()) else 1.0
        dist.all_reduce(flags, group=self.group)
        self.bytes.sent += flags.numel() * 4
        bad = [r for r in range(self.world_size) if flags[r] > 0]
        if bad:
            raise CompressionError(f"DiLoCo (compressor {self.codec_name!r}): the pseudo-gradient of fragment "
                                   f"{fragment} holds NaN/Inf on rank(s) {bad} at inner step {self.inner_steps}; the "
                                   "inner steps diverged (lower the inner learning rate or clip gradients)", bad)

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
                "error_feedback": self.error_feedback, "buffers": self.buffer_rule,
                "world_size": self.world_size, "rank": self.rank}

    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state, for ``torch.save`` (loadable with ``weights_only=True``).

        Each rank saves its own: the residuals differ per rank. Save the model and the inner
        optimizer alongside (their own ``state_dict()``).

        Returns
        -------
        dict
            ``version``; ``settings`` (codec and options, H, F, error feedback, world size, rank);
            ``inner_steps``, ``outer_steps``, ``fragment_syncs``; ``starts`` (the outer copies, CPU
            tensors); ``outer_optimizer`` (its ``state_dict()``: momentum); ``feedback`` (per fragment
            the error-feedback state as CPU tensors: ``residual``, codec memory; ``{}`` without);
            ``bytes`` (``sent``, ``dense``); ``sync_seconds``.
        """
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
            "bytes": {"sent": self.bytes.sent, "dense": self.bytes.dense},
            "sync_seconds": self.sync_seconds,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what [`state_dict`][fedcomp.distributed.DiLoCo.state_dict] returned on this rank (after loading the
        model's own).

        Raises
        ------
        ValueError
            A different layout version, codec, options, H, F, error-feedback setting, world size or
            rank (naming the setting), or outer copies of other shapes.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"DiLoCo state version {state.get('version')!r}, expected {STATE_VERSION}")
        saved, mine = dict(state["settings"]), self._settings()
        for key in mine:
            if saved.get(key) != mine[key]:
                raise ValueError(f"DiLoCo checkpoint has {key}={saved.get(key)!r}, this run {key}={mine[key]!r}")
        starts = state["starts"]
        if [tuple(s.shape) for s in starts] != [tuple(s.shape) for s in self.starts]:
            raise ValueError("DiLoCo checkpoint's outer copies do not match the model's parameters")
        with torch.no_grad():
            for s, saved_s in zip(self.starts, starts):
                s.copy_(saved_s)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for ef, st in zip(self.feedback, state["feedback"]):
            if ef is not None:
                ef.set_state({k: v.numpy() for k, v in st.items()})
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])
        self._fragment_syncs = [int(n) for n in state["fragment_syncs"]]
        self.bytes = ByteCount(int(state["bytes"]["sent"]), int(state["bytes"]["dense"]))
        self.sync_seconds = float(state["sync_seconds"])
