"""Local DP: each client clips and noises its whole update before compression (Flower-free)."""

from __future__ import annotations

from dataclasses import dataclass

from fedcomp.privacy.client_level import ClientLevelDP, check_gaussian_parameters


@dataclass(frozen=True)
class LocalDP:
    """Local update noise: each client clips its whole update to ``clipping_norm`` and adds
    N(0, (noise_multiplier·clipping_norm)²) *before* compression and error feedback, so every
    selection (top-k positions, signs, STC's mean) is computed from the noisy update.

    Raises
    ------
    ValueError
        ``clipping_norm`` <= 0 or ``noise_multiplier`` < 0.
    """

    clipping_norm: float
    noise_multiplier: float
    target_delta: float = 1e-5

    def __post_init__(self) -> None:
        check_gaussian_parameters(self.clipping_norm, self.noise_multiplier, self.target_delta)

    def epsilon(self, rounds: int, target_delta: float | None = None) -> float:
        """Per-client epsilon of ``rounds`` noisy releases (RDP, q = 1), inf without noise."""
        delta = self.target_delta if target_delta is None else target_delta
        return ClientLevelDP(self.clipping_norm, self.noise_multiplier, delta).epsilon(rounds)
