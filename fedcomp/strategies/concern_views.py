"""`CompressedStrategy`'s concerns and their settings, where users look for them.

Each concern (admission, privacy, Poisson sampling, the download, EF21) is an object built and checked
against the others at construction (`fedcomp.strategies.composition`). The wrapper shows each concern and
the settings users reach for (``strategy.max_epsilon``, ``strategy.downstream``, ...) as read-only
attributes: a new value would bypass the checks the objects passed together, so setting one is refused
with a message that says to build a new strategy.
"""

from __future__ import annotations


def _read_only(name: str):
    def refuse(self, value) -> None:
        raise AttributeError(f"CompressedStrategy.{name} is set at construction (checked there against the other "
                             "concerns): build a new strategy with the setting you want")
    return refuse


def _setting(concern: str, name: str, doc: str) -> property:
    """A read-only view of a setting of one of the concerns."""
    return property(lambda self: getattr(getattr(self, concern), name), _read_only(name), doc=doc)


def _concern(name: str, doc: str) -> property:
    """One of the concerns (read-only: the hooks hold it)."""
    return property(lambda self: getattr(self._concerns, name), _read_only(name), doc=doc)


class ConcernViews:
    """Mixin of `CompressedStrategy`: its concerns (``self._concerns``, `composition.Concerns`) and their
    settings as read-only attributes.

    Raises
    ------
    AttributeError
        Setting any of them.
    """

    admission = _concern("admission", "Which replies count (`admission.Admission`).")
    privacy = _concern("privacy", "DP and the epsilon budget (`privacy_budget.Privacy`).")
    sampling = _concern("sampling", "Poisson client sampling (None: the inner strategy's sample is kept).")
    download = _concern("download", "The download as resolved (`fedcomp.download.Download`).")
    downstream = _concern("downstream", "The download's sender (None: the model travels dense).")
    ef21 = _concern("ef21", "EF21's server estimate (None: no EF21).")
    hooks = _concern("hooks", "The concerns that see each message and reply of a round, in calling order.")
    client_dp = _setting("privacy", "client_dp", "Client-level DP-FedAvg (None: the inner strategy aggregates).")
    local_dp = _setting("privacy", "local_dp", "Local DP settings sent to clients (None: none).")
    max_epsilon = _setting("privacy", "max_epsilon", "The privacy budget (None: none).")
    stopped_reason = _setting("privacy", "stopped_reason", 'Why no further rounds are run ("" while rounds go on).')
    max_num_examples = _setting("admission", "max_num_examples", "Largest ``num-examples`` a reply may claim.")
    require_compression = _setting("admission", "require_compression", "Whether dense replies are refused.")

    @property
    def poisson_rate(self) -> float | None:
        """Poisson client-sampling rate q (None: the inner strategy's sample is kept)."""
        return None if self.sampling is None else self.sampling.rate


__all__ = ["ConcernViews"]
