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
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

#: ``Array.stype`` of a tensor sent as its seeded-init rule: ``data`` = little-endian float64 bound.
INIT_STYPE = "fedcomp.seeded-init.v1"
#: Train-config key carrying the seed of a seeded initial model.
INIT_SEED = "fedcomp-init-seed"


def _tensor_seed(seed: int, key: str) -> int:
    """A 63-bit seed per (run seed, tensor name): tensors do not share random streams."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") >> 1


def seeded_tensor(key: str, shape: tuple[int, ...], bound: float, seed: int) -> np.ndarray:
    """float32 values uniform in ``[-bound, bound]`` from ``(seed, key)``; zeros if ``bound == 0``.

    Parameters
    ----------
    key : str
        Tensor name (part of the stream's seed).
    shape : tuple of int
        Any shape (0-d and zero-element included).
    bound : float
        Finite, >= 0.
    seed : int
        The run's init seed (any integer).

    Raises
    ------
    ValueError
        A negative or non-finite bound.
    """
    if not math.isfinite(bound) or bound < 0:
        raise ValueError(f"seeded init of '{key}': bound must be finite and >= 0, got {bound!r}")
    n = int(np.prod(shape)) if shape else 1
    if bound == 0.0:
        return np.zeros(shape, dtype=np.float32)
    g = torch.Generator().manual_seed(_tensor_seed(seed, key))
    return torch.empty(n, dtype=torch.float32).uniform_(-bound, bound, generator=g).numpy().reshape(shape)


@dataclass(frozen=True)
class SeededInit:
    """A model's initial float tensors as (seed, bound per tensor): bound 0 means zeros.

    Parameters
    ----------
    seed : int
        Sent to the clients in the train config (it is no secret: it only fixes the starting point).
    bounds : dict of str to float
        Every float tensor of the model (the adapter state dict in LoRA mode) -> its bound.
    """

    seed: int
    bounds: Mapping[str, float] = field(default_factory=dict)

    def values(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """The initial tensors (float32) for ``shapes`` (every key must have a bound).

        Raises
        ------
        KeyError
            A key without a bound.
        """
        return {k: seeded_tensor(k, tuple(s), float(self.bounds[k]), self.seed) for k, s in shapes.items()}


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


__all__ = ["INIT_SEED", "INIT_STYPE", "SeededInit", "lora_init", "seeded_tensor"]
