"""A client's first model without the dense download: the seeded start and the compressed start.

The downstream sender (`fedcomp.download.sender`) gives a node that holds nothing the first
broadcast model B_1 in one of three ways, by its ``init`` policy:

- a **seeded start**: B_1 is drawn from a seed; the node gets the seed and one rule per float tensor
  (`fedcomp.download.seeded_init`) and builds B_1 itself, bit for bit. For LoRA adapters at
  peft's initialisation (``lora_B`` = 0, ``lora_A`` Kaiming-uniform: Hu et al., ICLR 2022) the
  strategy recognises them (``"auto"``) and redraws ``lora_A`` from the seed, so a third-party app
  writes no seeding code; likewise (``"auto"``) a model as PyTorch initialises it (every large float
  tensor a uniform i.i.d. draw, as ``Linear``/``Conv`` weights and biases are, or a constant:
  `pytorch_default_init`), its small tensors travelling exactly; for any model trained from scratch
  (``"seeded"``) every float tensor that looks like a random draw is redrawn with its mean and
  variance, and the others (buffers such as a sinusoidal table or a mask) travel exactly beside the seed;
- a **compressed start** (``"auto"`` for any other model, or a codec name): B_1 is the initial model
  coded with ``int8`` (or that codec), one payload for every node; what it leaves out stays in the
  server's error feedback ``G - B`` and reaches the nodes with later broadcasts;
- ``"dense"``: the model dense.
"""

from __future__ import annotations

import hashlib
import math
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord
from flwr.common.logger import log

from fedcomp.compression import available_compressors, codecs_with
from fedcomp.download.layout import is_batchnorm_stat, round_to_dtypes
from fedcomp.download.seeded_init import SeededInit, looks_drawn, lora_init, seeded_like
from fedcomp.statedict import FlatModel, is_float_dtype, numpy_dict

#: First-contact policies besides a codec name.
INIT_POLICIES = ("auto", "seeded", "dense")
#: The codec of a compressed start under ``init = "auto"``.
START_CODEC = "int8"


def check_init_policy(init: SeededInit | str) -> SeededInit | str:
    """``init`` if it is a `SeededInit`, a policy of `INIT_POLICIES` or a codec that can
    code one flat vector.

    Raises
    ------
    ValueError
        Any other value (naming it and the choices), a per-tensor-only codec (PowerSGD, ATOMO), or
        a `SeededInit` whose seed is not an integer in ``[0, 2**63)``.
    """
    if isinstance(init, SeededInit):  # the seed travels as an int64 config value clients check (>= 0)
        if isinstance(init.seed, bool) or not isinstance(init.seed, int) or not 0 <= init.seed < 2**63:
            raise ValueError(f"downstream init: SeededInit seed must be an integer in [0, 2**63), got {init.seed!r}")
        return init
    if not isinstance(init, str) or (init not in INIT_POLICIES and init not in available_compressors()):
        raise ValueError(f"downstream init must be a SeededInit, one of {INIT_POLICIES} or a codec name "
                         f"({available_compressors()}), got {init!r}")
    if init in codecs_with(per_tensor_only=True):
        raise ValueError(f"downstream init cannot be {init!r}: the start is one flat vector, no matrix")
    return init


def starting_model(init: SeededInit | str, arrays: ArrayRecord) -> tuple[ArrayRecord, SeededInit | str]:
    """The initial global model and the policy that stays in force.

    ``"auto"`` replaces nothing but LoRA adapters at peft's initialisation (their ``lora_A`` by the
    seed's draw from the same distribution) and models at PyTorch's default initialisation
    (`pytorch_default_init`); then the policy becomes that `SeededInit`, else `START_CODEC`.
    ``"seeded"`` replaces every float tensor whose values look like a random draw (`looks_drawn`,
    `seeded_like`): a state_dict does not tell parameters from buffers, so a fixed buffer (a sinusoidal
    table, a mask) keeps its values, which the first contact sends exactly (`SeededInit.exact`). Integer/bool
    tensors are kept. The draw's
    seed is a hash of ``arrays`` (an app that seeds its own initialisation per run gets a different
    start per run). The result equals what a new client builds from the seed, bit for bit (in each
    tensor's dtype). Other policies return ``(arrays, init)`` unchanged.

    Raises
    ------
    ValueError
        A float tensor of the initial model holds NaN or Inf (every policy: named, with its count,
        before any client is sent it), or ``"seeded"`` with BatchNorm
        statistics that are not constant (a model that ran forward passes: a drawn running variance
        can be negative).
    """
    values, dtypes = numpy_dict(arrays)
    floats = {k: v for k, v in values.items() if is_float_dtype(dtypes[k])}
    bad = {k: int(v.size - np.count_nonzero(np.isfinite(v))) for k, v in floats.items()}
    bad = {k: c for k, c in bad.items() if c}
    if bad:
        first = next(iter(bad))
        raise ValueError(f"the initial model is not finite: tensor {first!r} holds {bad[first]} NaN/Inf entries"
                         + (f" ({len(bad) - 1} more tensors too)" if len(bad) > 1 else "")
                         + "; fix the model (or the checkpoint) it is initialised from")
    if not isinstance(init, str) or init not in ("auto", "seeded"):
        return arrays, init
    if init == "seeded":  # a drawn running variance can be negative (NaN in eval): only constants are kept
        moved = [k for k, v in floats.items() if is_batchnorm_stat(k) and v.size and not np.all(v == v.flat[0])]
        if moved:
            raise ValueError(f"downstream init 'seeded': BatchNorm statistics {moved[:3]} are not at their "
                             "initialisation (the model ran forward passes, it is not trained from scratch); "
                             "use the init 'auto' (a compressed start)")
    seed = model_seed(floats)  # another initial model (another run seed), another draw
    # Only what looks like a parameter's random draw is redrawn: a state_dict does not say which
    # entries are buffers, and a fixed buffer (a sinusoidal table, a mask) replaced by noise stays noise.
    fixed = [k for k, v in floats.items() if not looks_drawn(v)] if init == "seeded" else []
    seeded = (seeded_like(floats, seed, exact=fixed) if init == "seeded"
              else peft_adapters(floats, seed) or pytorch_default_init(floats, seed))
    if seeded is None:
        return arrays, START_CODEC
    log(INFO, "fedcomp downstream: seeded start (%d tensors, %d of them sent exactly): new clients build the "
        "first model from a seed", len(floats), len(seeded.exact))
    drawn = seeded.values({k: v.shape for k, v in floats.items() if k not in seeded.exact})
    model = FlatModel({**values, **drawn}, dtypes)
    model.flat[...] = round_to_dtypes(model, model.float_keys, model.flat.copy())
    return model.record(check=True), seeded


def peft_adapters(floats: dict[str, np.ndarray], seed: int) -> SeededInit | None:
    """LoRA's seeded start if ``floats`` are adapters as peft initialises them (every key a
    ``lora_`` tensor; ``lora_A`` within ``+-1/sqrt(fan_in)``, every other tensor zero), else None."""
    if not floats or not all("lora_" in k for k in floats):
        return None
    init = lora_init({k: v.shape for k, v in floats.items()}, seed)
    for k, v in floats.items():
        bound = init.bounds[k]
        top = float(np.max(np.abs(v.astype(np.float64)))) if v.size else 0.0
        if not math.isfinite(top) or top > bound * (1 + 1e-6):
            return None
    return init


#: Weights with fewer entries travel exactly in `pytorch_default_init`'s start (too few values to tell a
#: uniform draw from another), as do biases.
MIN_SEEDED_NUMEL = 256


def _default_bound(key: str, x: np.ndarray, floats: dict[str, np.ndarray]) -> float | None:
    """PyTorch's default-initialisation bound of tensor ``key``: ``1/sqrt(fan_in)`` of a weight (the product
    of its dimensions after the first), or of the weight beside a bias (``<layer>.bias`` and
    ``<layer>.weight``); None for a tensor of neither kind."""
    if x.ndim >= 2:
        return 1.0 / math.sqrt(math.prod(x.shape[1:]))
    weight = floats.get(key[: -len("bias")] + "weight") if key.endswith("bias") else None
    if weight is not None and np.ndim(weight) >= 2:
        return 1.0 / math.sqrt(math.prod(np.shape(weight)[1:]))
    return None


def _uniform_draw(x: np.ndarray, bound: float, rounding: float) -> bool:
    """Whether ``x`` (at least `MIN_SEEDED_NUMEL` entries) reads as i.i.d. uniform in ``+-bound``: every entry
    within the bound (to the dtype's ``rounding``), the largest within ``10/n`` of it (n draws fall short of
    that with probability ``e**-10``), mean and standard deviation those of the uniform within about five
    standard errors, no run of exact zeros (a pruned weight), no structure between neighbours (`looks_drawn`)."""
    n = x.size
    top = float(np.abs(x).max())
    if not bound * (1 - 10 / n) <= top <= bound * (1 + max(rounding, 1e-6)):
        return False
    std = bound / math.sqrt(3.0)
    if abs(float(x.mean())) > 5 * std / math.sqrt(n) or abs(float(x.std()) / std - 1) > 2.5 / math.sqrt(n):
        return False
    return np.count_nonzero(x == 0.0) <= n // 1000 and looks_drawn(x)


def pytorch_default_init(floats: dict[str, np.ndarray], seed: int) -> SeededInit | None:
    """A seeded start for a model as PyTorch initialises it, or None for any other model.

    PyTorch draws ``Linear``/``Conv`` weights and biases uniformly in ``+-1/sqrt(fan_in)``, ``fan_in``
    the product of the weight's dimensions after the first (Kaiming-uniform with ``a = sqrt(5)``:
    ``torch.nn.Linear.reset_parameters``; He et al., ICCV 2015), and sets normalisation layers to
    constants. A model qualifies when every float tensor is a constant (BatchNorm statistics included),
    or a weight or bias within its layer's bound; and every weight of at least `MIN_SEEDED_NUMEL`
    entries reads as a uniform draw of that bound (`_uniform_draw`: its spread, largest entry, mean and
    neighbours), no two of them equal (tied weights keep their values). The start draws each such
    weight again uniformly in ``+-1/sqrt(fan_in)``: the same distribution, another draw, so a new client
    builds the first model from a seed and a few bytes a tensor; biases and small weights travel exactly.

    A model that trained, even briefly, has tensors past their bounds and gets the compressed start; so
    do other initialisations (Xavier, normal, truncated normal, LSTM/GRU's ``1/sqrt(hidden_size)``),
    pruned or rescaled weights and BatchNorm statistics that ran forward passes. A model that keeps a
    layer frozen at its random initialisation while the others trained within their bounds cannot be
    told from a fresh one: pass ``Download(init="int8")`` for it.

    Parameters
    ----------
    floats : dict of str to numpy.ndarray
        The model's float tensors (finite, any float dtype and shape).
    seed : int
        The draw's seed (`model_seed`).
    """
    drawn, exact = [], []
    for k, v in floats.items():
        x = np.asarray(v, dtype=np.float64)
        if x.size == 0 or np.all(x == x.flat[0]):
            continue
        bound = None if is_batchnorm_stat(k) else _default_bound(k, x, floats)
        if bound is None:
            return None
        rounding = 2.0 * float(np.finfo(np.asarray(v).dtype).eps)
        if x.ndim >= 2 and x.size >= MIN_SEEDED_NUMEL:
            if not _uniform_draw(x, bound, rounding):
                return None
            drawn.append(k)
        elif float(np.abs(x).max()) <= bound * (1 + max(rounding, 1e-6)):
            exact.append(k)
        else:
            return None
    for i, k in enumerate(drawn):  # one tensor under two names: redrawn apart it would come untied
        if any(floats[j].shape == floats[k].shape and np.array_equal(floats[j], floats[k]) for j in drawn[:i]):
            return None
    if not drawn:
        return None
    rules = seeded_like(floats, seed, exact=exact)  # constants and exact tensors; the weights drawn as PyTorch does
    bounds = {**rules.bounds, **{k: 1.0 / math.sqrt(math.prod(floats[k].shape[1:])) for k in drawn}}
    return SeededInit(seed, bounds, {k: c for k, c in rules.centers.items() if k not in drawn}, rules.exact)


def model_seed(floats: dict[str, np.ndarray]) -> int:
    """A 63-bit seed from the initial model's names and values (SHA-256)."""
    h = hashlib.sha256()
    for k, v in floats.items():
        h.update(k.encode())
        h.update(np.ascontiguousarray(v).tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 1


__all__ = ["INIT_POLICIES", "MIN_SEEDED_NUMEL", "START_CODEC", "check_init_policy", "model_seed", "peft_adapters",
           "pytorch_default_init", "starting_model"]
