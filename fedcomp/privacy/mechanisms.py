"""The Gaussian mechanism on whole updates (Flower-free): clip to an L2 norm, add noise from a
generator seeded by the OS CSPRNG.

Source: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016 (Gaussian mechanism
with clipping); McMahan et al., "Learning Differentially Private Recurrent Language Models",
ICLR 2018 (on client updates).
"""

from __future__ import annotations

import secrets

import torch


def secure_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A torch Generator seeded from the OS CSPRNG (``secrets``): nothing in the run or node
    config (run seed, partition, round) can reproduce its draws. For privacy noise only, on the
    client (local DP) and the server (client-level DP) alike."""
    gen = torch.Generator(device=device)
    gen.manual_seed(secrets.randbits(63))
    return gen


def clip_and_noise(update: torch.Tensor, clipping_norm: float, noise_multiplier: float,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Clip a flat update to L2 norm ``clipping_norm``, then add N(0, (noise_multiplier·clipping_norm)²).

    Parameters
    ----------
    update : torch.Tensor
        1-D float tensor (the whole model update, flattened).
    clipping_norm : float
        C > 0.
    noise_multiplier : float
        z >= 0 (0: clipping only).
    generator : torch.Generator, optional
        Source of the Gaussian noise.

    Returns
    -------
    torch.Tensor
        float32, same shape: ``update * min(1, C/||update||) + N(0, (zC)^2 I)``.
    """
    u = update.float().clone()
    clip_and_noise_([u], clipping_norm, noise_multiplier, generator)
    return u


def clip_and_noise_(buffers: list[torch.Tensor], clipping_norm: float, noise_multiplier: float,
                    generator: torch.Generator | None = None) -> None:
    """`clip_and_noise` in place over the concatenation of ``buffers`` (float32 tensors that
    together hold one update, e.g. one per payload): the L2 norm is taken over all of them, each is
    scaled by ``min(1, C/norm)`` and gets N(0, (zC)^2) noise per entry; no concatenated copy."""
    norm = sum(float(torch.linalg.vector_norm(b.double())) ** 2 for b in buffers) ** 0.5
    factor = min(1.0, clipping_norm / norm) if norm > 0 else 1.0
    std = noise_multiplier * clipping_norm
    for b in buffers:
        if factor < 1.0:
            b.mul_(factor)
        if std > 0:
            b.add_(torch.randn(b.shape, generator=generator, dtype=torch.float32).mul_(std))
