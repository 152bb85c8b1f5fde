"""Initial weights both sides can build from a seed, so the first broadcast needs no dense weights.

LoRA (Hu et al., ICLR 2022, Sec. 4.1) starts every adapter with ``B = 0`` and ``A`` drawn at random;
peft draws ``A`` with ``kaiming_uniform_(a=sqrt(5))``, i.e. uniform in ``[-1/sqrt(fan_in),
1/sqrt(fan_in)]`` (``peft/tuners/lora/layer.py``, ``reset_lora_parameters``). If the server sends
the seed and each tensor's bound instead of the values, a client rebuilds the same tensors bit for
bit (``torch.Generator`` on the CPU is deterministic for a given seed), so the first download of a
FlowerTune-style run costs bytes per tensor, not 4 bytes per parameter.

Flower-free: the server's downstream code and the client mod share it.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

#: ``Array.stype`` of a tensor sent as its seeded-init rule: ``data`` = little-endian float64 bound
#: (8 bytes: values uniform in ``[-bound, bound]``), or bound and center (16 bytes: ``center`` +
#: uniform in ``[-bound, bound]``).
INIT_STYPE = "fedcomp.seeded-init.v1"
#: Train-config key carrying the seed of a seeded initial model.
INIT_SEED = "fedcomp-init-seed"
#: Largest bound (the draw's range ``2 * bound`` stays finite in float32) and center of a rule.
MAX_BOUND = float(np.finfo(np.float32).max) / 2
MAX_CENTER = float(np.finfo(np.float32).max)


def _rule_error(bound: float, center: float) -> str | None:
    """Why ``(bound, center)`` is no rule (None: it is one): values are drawn in float32."""
    if not math.isfinite(bound) or not 0 <= bound <= MAX_BOUND:
        return f"bound must be finite, >= 0 and <= {MAX_BOUND:.6g}, got {bound!r}"
    if not math.isfinite(center) or abs(center) > MAX_CENTER:
        return f"center must be finite and within +-{MAX_CENTER:.6g}, got {center!r}"
    return None


def _tensor_seed(seed: int, key: str) -> int:
    """A 63-bit seed per (run seed, tensor name): tensors do not share random streams."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") >> 1


def seeded_tensor(key: str, shape: tuple[int, ...], bound: float, seed: int, center: float = 0.0) -> np.ndarray:
    """float32 values ``center`` + uniform in ``[-bound, bound]`` from ``(seed, key)``; every entry
    ``center`` if ``bound == 0``.

    Parameters
    ----------
    key : str
        Tensor name (part of the stream's seed).
    shape : tuple of int
        Any shape (0-d and zero-element included).
    bound : float
        Finite, in ``[0, MAX_BOUND]``.
    seed : int
        The run's init seed (any integer).
    center : float
        Finite, within float32's range; added to every entry (0 for LoRA's rules).

    Raises
    ------
    ValueError
        A bound or center outside those ranges, or a negative dimension.
    """
    if (why := _rule_error(bound, center)) is not None:
        raise ValueError(f"seeded init of '{key}': {why}")
    if any(int(d) < 0 for d in shape):
        raise ValueError(f"seeded init of '{key}': negative dimension in shape {tuple(shape)}")
    n = math.prod(int(d) for d in shape)
    if bound == 0.0:
        return np.full(shape, center, dtype=np.float32)
    g = torch.Generator().manual_seed(_tensor_seed(seed, key))
    out = torch.empty(n, dtype=torch.float32).uniform_(-bound, bound, generator=g).numpy().reshape(shape)
    if center != 0.0:
        out += np.float32(center)
    return out


@dataclass(frozen=True)
class SeededInit:
    """A model's initial float tensors as (seed, bound per tensor): bound 0 means zeros.

    Parameters
    ----------
    seed : int
        Sent to the clients in the train config (it is no secret: it only fixes the starting point).
    bounds : dict of str to float
        Every float tensor of the model (the adapter state dict in LoRA mode) -> its bound.
    centers : dict of str to float
        Tensors whose values are centred elsewhere than 0 -> their center (others: 0). A tensor with
        bound 0 is the constant ``center`` (BatchNorm's weight 1, a zero bias).
    exact : frozenset of str
        Tensors the seed does not draw (a fixed buffer: a sinusoidal table, a mask): their rule is
        zeros (bound 0) and the server sends their values in the first contact's start payload.
    """

    seed: int
    bounds: Mapping[str, float] = field(default_factory=dict)
    centers: Mapping[str, float] = field(default_factory=dict)
    exact: frozenset[str] = frozenset()

    def rule(self, key: str) -> bytes:
        """The ``data`` of ``key``'s `INIT_STYPE` Array: ``<d`` bound, or ``<dd`` bound, center."""
        center = float(self.centers.get(key, 0.0))
        bound = float(self.bounds[key])
        return struct.pack("<d", bound) if center == 0.0 else struct.pack("<dd", bound, center)

    def values(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The initial tensors (float32) for ``shapes`` (every key must have a bound).

        Raises
        ------
        KeyError
            A key without a bound.
        """
        return {k: seeded_tensor(k, tuple(s), float(self.bounds[k]), self.seed, float(self.centers.get(k, 0.0)))
                for k, s in shapes.items()}


def parse_rule(key: str, data: bytes) -> tuple[float, float]:
    """``(bound, center)`` of a received `INIT_STYPE` rule.

    Raises
    ------
    ValueError
        Not 8 or 16 bytes, a bound outside ``[0, MAX_BOUND]`` or a center beyond float32 (or
        non-finite).
    """
    if len(data) == 8:
        (bound,), center = struct.unpack("<d", data), 0.0
    elif len(data) == 16:
        bound, center = struct.unpack("<dd", data)
    else:
        raise ValueError(f"seeded-init rule of '{key}' must be 8 or 16 bytes, got {len(data)}")
    if (why := _rule_error(bound, center)) is not None:
        raise ValueError(f"seeded-init rule of '{key}': {why}")
    return bound, center


#: Fewest entries of a tensor `looks_drawn` can tell from a fixed one (smaller ones are kept).
MIN_DRAWN_NUMEL = 16
#: At most this many distinct values in a strided sample: a mask or a table of levels, not a draw.
_FEW_VALUES = 16
#: Entries of the strided sample `looks_drawn` counts distinct values in.
_VALUE_SAMPLE = 4096
#: A neighbour correlation beyond this many standard errors (``1 / sqrt(pairs)``) is structure.
_CORRELATION_SIGMAS = 6.0


def looks_drawn(a: np.ndarray) -> bool:
    """Whether a float tensor's values look like an i.i.d. random draw, as PyTorch's initialisers
    make a parameter's (uniform, normal, Kaiming, Xavier): at least `MIN_DRAWN_NUMEL` entries,
    more than a few distinct values, and no correlation between neighbours along any axis beyond
    what chance gives (6 standard errors, ``6 / sqrt(pairs)``). A fixed buffer fails it: a causal
    mask (two values, long runs), a sinusoidal positional table (neighbouring positions correlate
    near 1), a constant. Only a tensor that passes may be redrawn from a seed (`seeded_like`);
    the test errs towards keeping a tensor, which costs bytes, never the model.

    Parameters
    ----------
    a : numpy.ndarray
        Any float dtype and shape, finite.
    """
    x = np.asarray(a, dtype=np.float64)
    if x.size < MIN_DRAWN_NUMEL:
        return False
    sample = x.reshape(-1)[:: max(x.size // _VALUE_SAMPLE, 1)]
    distinct = np.unique(sample).size
    if distinct <= _FEW_VALUES and 2 * distinct <= sample.size:
        return False
    for axis in range(x.ndim):
        if x.shape[axis] < 2:
            continue
        moved = np.moveaxis(x, axis, -1)
        u, v = moved[..., :-1].reshape(-1), moved[..., 1:].reshape(-1)
        u, v = u - u.mean(), v - v.mean()
        scale = math.sqrt(float(u @ u) * float(v @ v))
        if scale == 0.0 or abs(float(u @ v)) / scale > _CORRELATION_SIGMAS / math.sqrt(u.size):
            return False
    return True


def seeded_like(arrays: Mapping[str, np.ndarray], seed: int, exact: Iterable[str] = ()) -> SeededInit:
    """A seeded start with the first two moments of a freshly initialised model, per float tensor.

    A tensor whose entries are all equal (a zero bias, BatchNorm's weight 1, a 0-d or one-element
    parameter) stays that constant exactly; a tensor named in ``exact`` is not drawn either (its
    rule is zeros, `SeededInit.exact`: its values travel beside the seed). Any other tensor
    becomes ``mean`` + uniform in
    ``[-sqrt(3) std, sqrt(3) std]``: the same mean and variance. PyTorch's default initialisation
    of ``Linear``/``Conv`` weights and biases is itself uniform (Kaiming-uniform with ``a = sqrt(5)``:
    bound ``1/sqrt(fan_in)``, He et al., ICCV 2015), so for such layers the seeded start is a draw
    from the same distribution; a normal initialisation (embeddings) keeps its scale but not its
    shape. Only for models trained from scratch: a pretrained model is not a random draw, and
    replacing it by one throws its training away.

    Parameters
    ----------
    arrays : dict of str to numpy.ndarray
        The model's float tensors (any float dtype, any shape; integer/bool tensors are not passed).
    seed : int
        The init seed (no secret: it fixes the starting point).
    exact : iterable of str
        Tensors that must keep their values (buffers: only trainable parameters may be redrawn);
        constants among them keep their constant rule.

    Raises
    ------
    ValueError
        A tensor with a non-finite entry, or an ``exact`` name that is not in ``arrays``.
    """
    bounds, centers, kept = {}, {}, set()
    exact = set(exact)
    if exact - set(arrays):
        raise ValueError(f"seeded start: exact tensors {sorted(exact - set(arrays))[:3]} are not in the model")
    for k, a in arrays.items():
        x = np.asarray(a, dtype=np.float64).reshape(-1)
        if x.size and not np.isfinite(x).all():
            raise ValueError(f"seeded start: '{k}' has non-finite entries")
        if k in exact and x.size and not np.all(x == x[0]):
            bounds[k], center = 0.0, 0.0
            kept.add(k)
        elif x.size == 0 or np.all(x == x[0]):
            bounds[k], center = 0.0, (float(x[0]) if x.size else 0.0)
        else:
            bounds[k], center = math.sqrt(3.0) * float(x.std()), float(x.mean())
        if center != 0.0:
            centers[k] = center
    return SeededInit(seed, bounds, centers, frozenset(kept))


def lora_init(shapes: Mapping[str, tuple[int, ...]], seed: int) -> SeededInit:
    """LoRA's initial adapters as peft makes them: ``lora_A`` (shape ``(r, fan_in)`` for Linear) uniform
    in ``+-1/sqrt(fan_in)``, every other adapter tensor (``lora_B``, ...) zero.

    Parameters
    ----------
    shapes : dict of str to tuple
        The adapter state dict's shapes (peft's ``get_peft_model_state_dict`` names).
    seed : int
        Init seed.
    """
    bounds = {}
    for k, s in shapes.items():
        if ".lora_A." in k or k.endswith("lora_A.weight"):
            fan_in = int(np.prod(s[1:])) if len(s) > 1 else 1
            bounds[k] = 1.0 / math.sqrt(max(fan_in, 1))
        else:
            bounds[k] = 0.0
    return SeededInit(seed, bounds)


__all__ = ["INIT_SEED", "INIT_STYPE", "SeededInit", "looks_drawn", "lora_init", "parse_rule", "seeded_like",
           "seeded_tensor"]
