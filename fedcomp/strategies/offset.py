"""``RoundOffset``: run a strategy's rounds ``offset + 1, offset + 2, ...`` (resuming a run)."""

from __future__ import annotations

from typing import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy


class RoundOffset(Strategy):
    """Delegate every call to ``inner`` with ``server_round + offset``.

    Flower's ``Strategy.start`` numbers rounds from 1; a resumed run continues at round
    ``offset + 1`` so that schedules, warm-up and per-round seeds continue where they stopped.

    Parameters
    ----------
    inner : Strategy
        The strategy to run (e.g. a ``CompressedStrategy``).
    offset : int
        Rounds already completed, >= 0.
    """

    def __init__(self, inner: Strategy, offset: int) -> None:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self.inner, self.offset = inner, int(offset)

    def summary(self) -> None:
        """Delegate."""
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Delegate with the shifted round."""
        return self.inner.configure_train(server_round + self.offset, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Delegate with the shifted round."""
        return self.inner.aggregate_train(server_round + self.offset, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Delegate with the shifted round."""
        return self.inner.configure_evaluate(server_round + self.offset, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Delegate with the shifted round."""
        return self.inner.aggregate_evaluate(server_round + self.offset, replies)
