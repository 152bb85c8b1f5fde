"""The server's privacy concerns of a round, apart from decoding and folding: Poisson client
sampling, the local-DP settings sent to clients, and the epsilon budget (``max-epsilon``).

Sources: McMahan et al., "Learning Differentially Private Recurrent Language Models", ICLR 2018
(client-level DP-FedAvg, Poisson sampling of clients); the accounting itself is in
`fedcomp.privacy`.
"""

from __future__ import annotations

import math
import statistics
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message
from flwr.common.logger import log

from fedcomp.privacy import ClientLevelDP, LocalDP
from fedcomp.privacy.accounting import checked_max_epsilon
from fedcomp.privacy.client_level import check_accountable
from fedcomp.util.validate import check_number
from fedcomp.protocol.round_hooks import RoundHook


class PoissonSampling(RoundHook):
    """Keep each train message the inner strategy produced independently with probability ``rate``
    (a round hook of `fedcomp.strategies.CompressedStrategy`, ``sampling=PoissonSampling(q)``).

    The inner strategy should select every connected node (``fraction_train = 1.0``); the sample
    is then a Poisson sample of that population, as amplification by sampling assumes.

    Parameters
    ----------
    rate : float
        q in (0, 1].
    seed : int, optional
        Tests only. None (default): OS entropy, as amplification needs a sample nobody can predict.

    Raises
    ------
    ValueError
        ``rate`` outside (0, 1].
    """

    def __init__(self, rate: float, seed: int | None = None) -> None:
        check_number(rate, "PoissonSampling rate q", lo=0.0, lo_open=True, hi=1.0)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"PoissonSampling seed must be an integer >= 0 or None (OS entropy), got {seed!r}")
        self.rate = float(rate)
        self._rng = np.random.default_rng(seed)
        self.in_use = False  # set once a strategy holds it: its draws belong to one run

    def sample(self, messages: list[Message]) -> tuple[list[Message], float]:
        """The kept messages and the expected count ``q * N`` (client-level DP's divisor)."""
        keep = self._rng.random(len(messages)) < self.rate
        return [m for m, k in zip(messages, keep, strict=True) if k], self.rate * len(messages)

    def on_messages(self, server_round: int, phase: str, arrays: Any, messages: list[Message],
                    sent: Any = None) -> list[Message]:
        """The kept train messages (`sample`); the round's divisor ``sent.sampled`` becomes ``q * N``."""
        if phase != "train":
            return messages
        messages, sent.sampled = self.sample(messages)
        return messages


class Privacy(RoundHook):
    """The privacy of a run: client-level DP (the server clips and noises), local DP (the clients
    do), and epsilon of the run so far against ``max_epsilon`` (a round hook of
    `fedcomp.strategies.CompressedStrategy`, ``privacy=Privacy(...)``).

    Epsilon comes from client-level DP's accountant, from local DP (rounds in which noisy
    updates left the clients, counted here), or from what DP-SGD clients report (``epsilon``,
    ``epsilon-next``: unverifiable, so the federation stops only when even the lowest projection
    exceeds the budget; a client whose own projection exceeds it refuses rounds itself).

    Parameters
    ----------
    client_dp : ClientLevelDP, optional
        Client-level DP-FedAvg on the decoded updates (clip each, sum / clients sampled, Gaussian
        noise); replaces the inner strategy's averaging and reports ``epsilon`` per round.
    local_dp : LocalDP, optional
        Ask clients to clip and noise their update before compression (sent in the train config).
    max_epsilon : float, optional
        Stop sending rounds before one would push any client's epsilon (client-level, local, or the
        ``epsilon`` clients report with DP-SGD) past this value. None: no budget (epsilon is still reported).

    Raises
    ------
    ValueError
        ``max_epsilon`` not a finite number > 0.
    """

    def __init__(self, client_dp: ClientLevelDP | None = None, local_dp: LocalDP | None = None,
                 max_epsilon: float | None = None) -> None:
        for name, value, kind in (("client_dp", client_dp, ClientLevelDP), ("local_dp", local_dp, LocalDP)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"Privacy({name}=...) must be a {kind.__name__} or None, got {type(value).__name__}")
        if client_dp is not None and local_dp is not None:
            raise ValueError("Privacy: client_dp and local_dp together are one mode too many (the accounting would "
                             "count one of them): choose client-level DP (the server noises) or local DP (the "
                             "clients do)")
        for dp in (client_dp, local_dp):  # the accountant must give a number for a round, before any round runs
            if dp is not None:
                check_accountable(dp.noise_multiplier, dp.target_delta, getattr(dp, "sample_rate", 1.0))
        self.client_dp = client_dp
        self.local_dp = local_dp
        self.max_epsilon = checked_max_epsilon(max_epsilon)
        self.in_use = False  # set once a strategy holds it: its accounting belongs to one run
        #: Why no further rounds are run ("" while rounds go on).
        self.stopped_reason = ""
        #: Rounds in which local-DP updates may have left the clients.
        self.local_rounds = 0
        #: Lowest ``epsilon-next`` clients reported (DP-SGD), 0.0 before any report.
        self.epsilon_next = 0.0
        #: Lowest ``epsilon`` clients reported, per round with reports (DP-SGD).
        self.epsilon_floor: list[float] = []
        self._any_replies = False  # whether the round being aggregated had replies

    # -- the round hook ------------------------------------------------------------------
    def configure(self, server_round: int, phase: str, config: ConfigRecord) -> bool:
        """Train: False once the round would exceed the budget (`exhausted`), else the local-DP
        settings added to ``config`` (`train_config`)."""
        if phase != "train":
            return True
        if self.exhausted(server_round):
            return False
        self.train_config(config)
        return True

    def on_replies(self, server_round: int, phase: str, replies: list[Message], folded: Any = None,
                   sent: Any = None) -> None:
        """Train: stop once every client refused the round for its own budget (`note_refusals`)."""
        if phase == "train":
            self._any_replies = bool(replies)
            self.note_refusals(server_round, replies)

    def on_round_end(self, server_round: int, metrics: dict[str, float], folded: Any) -> None:
        """Account the round and add its epsilon figures to ``metrics`` (`account`)."""
        self.account(server_round, self._any_replies, folded.stats, metrics)

    def train_config(self, config: ConfigRecord) -> None:
        """Add the local-DP settings clients apply before compressing (nothing without local DP)."""
        if self.local_dp is not None:
            config["local-dp-clipping-norm"] = self.local_dp.clipping_norm
            config["local-dp-noise-multiplier"] = self.local_dp.noise_multiplier

    def exhausted(self, server_round: int) -> bool:
        """True if ``server_round`` would push some client past ``max_epsilon`` (logged once)."""
        if self.max_epsilon is None or self.stopped_reason:
            return bool(self.stopped_reason)
        self.stopped_reason = over_budget(server_round, self._next_epsilon(), self.max_epsilon)
        if self.stopped_reason:
            log(WARNING, "%s", self.stopped_reason)
        return bool(self.stopped_reason)

    def _next_epsilon(self) -> float | None:
        if self.client_dp is not None:
            return self.client_dp.epsilon(self.client_dp.rounds + 1)
        if self.local_dp is not None:
            return self.local_dp.epsilon(self.local_rounds + 1)
        if self.epsilon_next:
            return self.epsilon_next
        if self.epsilon_floor:  # the lowest report: one client cannot stop everyone
            last = self.epsilon_floor[-1]
            return last + last - (self.epsilon_floor[-2] if len(self.epsilon_floor) >= 2 else 0.0)
        return None

    def note_refusals(self, server_round: int, replies: list[Message]) -> None:
        """Stop the run once every client refused a round for its own budget (DP-SGD clients)."""
        refused = [r for r in replies if r.has_error() and "privacy budget" in (r.error.reason or "")]
        if replies and len(refused) == len(replies) and not self.stopped_reason:
            self.stopped_reason = (f"privacy budget: every client refused round {server_round} (max-epsilon "
                                   "reached); no further rounds are run")
            log(WARNING, "%s", self.stopped_reason)

    def account(self, server_round: int, any_replies: bool, stats: list[dict], metrics: dict) -> None:
        """Count the round: add ``epsilon-max``/``epsilon-median`` (reported) or ``epsilon`` (local
        DP) to ``metrics`` and update the projections `exhausted` uses.

        Parameters
        ----------
        any_replies : bool
            Whether the round had replies (local DP counts a round only then).
        stats : list of dict
            Per-client stats with ``node``, ``epsilon``, ``epsilon-next`` (None when not reported).
        """
        reported = [s["epsilon"] for s in stats if s["epsilon"] is not None]
        if reported:
            metrics["epsilon-max"] = max(reported)
            metrics["epsilon-median"] = float(statistics.median(reported))
        if self.local_dp is not None and any_replies:  # counted once noisy updates may have left the clients
            self.local_rounds += 1
            metrics["epsilon"] = self.local_dp.epsilon(self.local_rounds)
        elif "epsilon" not in metrics and reported:
            self.epsilon_floor.append(min(reported))
        nexts = {s["node"]: s["epsilon-next"] for s in stats if s["epsilon-next"] is not None}
        if nexts:
            self.epsilon_next = min(nexts.values())
            if self.max_epsilon is not None:
                for node, e in sorted(nexts.items()):
                    if e > self.max_epsilon:
                        log(WARNING, "round %s: node %s reports a projected epsilon of %.3g > max-epsilon %s; it "
                            "will refuse further rounds, the others go on", server_round, node, e, self.max_epsilon)

    def state_dict(self) -> dict[str, Any]:
        """``{"privacy": the accounting}`` (JSON-serialisable; `accounting`)."""
        return {"privacy": self.accounting()}

    def load_state_dict(self, state: dict[str, Any], shapes: dict[str, tuple]) -> None:
        """Restore `state_dict` (`load_accounting`)."""
        self.load_accounting(state.get("privacy", {}))

    def accounting(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue the accounting (JSON-serialisable)."""
        return {"client-dp-rounds": None if self.client_dp is None else self.client_dp.rounds,
                "local-dp-rounds": self.local_rounds, "epsilon-next": self.epsilon_next,
                "epsilon-floor": list(self.epsilon_floor)}

    def load_accounting(self, state: dict[str, Any]) -> None:
        """Restore `accounting` (a key the state lacks keeps its start value)."""
        if state.get("client-dp-rounds") is not None and self.client_dp is not None:
            self.client_dp.rounds = int(state["client-dp-rounds"])
        self.local_rounds = int(state.get("local-dp-rounds") or 0)
        # JSON holds an infinite epsilon as null
        self.epsilon_next = _epsilon(state.get("epsilon-next", 0.0))
        self.epsilon_floor = [_epsilon(e) for e in state.get("epsilon-floor", [])]


def over_budget(server_round: int, next_epsilon: float | None, max_epsilon: float | None) -> str:
    """Why no further rounds are run if releasing ``server_round`` raises epsilon to ``next_epsilon`` above
    ``max_epsilon`` ("": the round fits, or there is no budget or no projection)."""
    if max_epsilon is None or next_epsilon is None or next_epsilon <= max_epsilon:
        return ""
    return (f"privacy budget: round {server_round} would raise epsilon to about {next_epsilon:.3g} > "
            f"max-epsilon {max_epsilon:g}; no further rounds are run")


def _epsilon(value: float | None) -> float:
    return math.inf if value is None else float(value)
