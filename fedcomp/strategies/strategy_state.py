"""What a resumed `CompressedStrategy` needs: its own carried remainders, the inner strategy's server
optimizer, and each round hook's state (the privacy accounting, EF21's estimate), as plain arrays and
JSON-serialisable values for a checkpoint (`fedcomp.app.checkpoint` writes them without pickle)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedcomp.strategies.wrapping import load_optimizer_state, optimizer_state


class StrategyState:
    """Mixin of `CompressedStrategy`: ``state_dict`` / ``load_state_dict`` over ``inner``, the remainders
    (``int_remainders``, ``half_remainders``) and ``hooks``."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: ``{"optimizer": {name: np.ndarray} of the inner strategy's server
        optimizer, "int-remainders": {tensor: float64 np.ndarray} of the integer rule, "half-remainders":
        {tensor: float32 np.ndarray} of the fp16/bf16 tensors' rounding}`` and each hook's state:
        ``"privacy"`` (JSON-serialisable accounting), ``"ef21"`` ({tensor: flat float64 np.ndarray}, EF21's
        server estimate h) and ``"ef21-folded"`` (``{"nodes", "rounds"}``; both empty without EF21)."""
        state = {"optimizer": optimizer_state(self.inner), "ef21": {}, "ef21-folded": {},
                 "int-remainders": {k: np.array(v, copy=True) for k, v in self.int_remainders.items()},
                 "half-remainders": {k: np.array(v, copy=True) for k, v in self.half_remainders.items()}}
        for hook in self.hooks:
            state.update(hook.state_dict())
        return state

    def load_state_dict(self, state: dict[str, Any], shapes: dict[str, tuple]) -> None:
        """Restore [`state_dict`][fedcomp.strategies.CompressedStrategy.state_dict]; ``shapes``: the model's
        tensor shapes (model order).

        Raises
        ------
        ValueError
            Optimizer state the inner strategy does not have or that does not fit ``shapes``; an
            EF21 estimate without EF21, or one that does not fit ``shapes``.
        """
        load_optimizer_state(self.inner, state.get("optimizer", {}), shapes)
        if state.get("ef21") and self.ef21 is None:
            raise ValueError("the checkpoint holds EF21's server estimate h but error-feedback is not 'ef21'")
        for hook in self.hooks:
            hook.load_state_dict(state, shapes)
        self.int_remainders = dict(state.get("int-remainders", {}))
        self.half_remainders = dict(state.get("half-remainders", {}))  # none in older checkpoints: zero


__all__ = ["StrategyState"]
