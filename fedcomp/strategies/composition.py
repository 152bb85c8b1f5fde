"""The concerns `fedcomp.strategies.CompressedStrategy` carries, checked against each other once and
built into its round hooks (`fedcomp.protocol.round_hooks`).

Each concern checks its own settings where it is configured (`Admission`, `Privacy`,
`PoissonSampling`, `fedcomp.download.Download`, the codec); what depends on two of them is decided
here, in one place:

- the library's download for ``downstream="auto"`` (`presets.library_downstream`: the upload codec's
  counterpart, dense where a compressed download cannot apply);
- EF21 needs a weighted-mean inner strategy, no client-level DP, and every client every round;
- error feedback under Flower's DP wrappers is refused (`codec_round.check_feedback_under_dp`);
- the downstream correction applies to weighted-mean rounds with a compressed download only.

Hooks are called in this order: admission, privacy, sampling, the download, EF21 (one node, one vote
before anything reads a reply; the budget before the inner strategy makes messages; sampling before the
download prepares them; EF21's check on the replies the download kept).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from flwr.serverapp.strategy import Strategy

from fedcomp.compression import codecs_with
from fedcomp.config import CodecConfig
from fedcomp.download.correction import correction_refusal
from fedcomp.download.options import Download
from fedcomp.download.round_hook import DenseDownload, DownloadHook
from fedcomp.download.sender import Downstream
from fedcomp.protocol.round_hooks import RoundHook
from fedcomp.strategies.admission import Admission
from fedcomp.strategies.aggregate import averages_by_weight
from fedcomp.strategies.codec_round import check_feedback_under_dp
from fedcomp.strategies.ef21_aggregate import EF21Aggregate, EF21Hook
from fedcomp.strategies.presets import library_downstream
from fedcomp.strategies.privacy_budget import PoissonSampling, Privacy

#: What ``CompressedStrategy(aggregation=...)`` accepts.
AGGREGATIONS = ("auto", "dense")

#: Settings that belong to one of the concerns, not to the codec: where each one goes.
CONCERN_SETTINGS = {
    "downstream_density": "downstream=Download(codec, density=...)",
    "downstream_init": "downstream=Download(codec, init=...)",
    "downstream_catchup": "downstream=Download(codec, catchup=...)",
    "downstream_max_copies": "downstream=Download(codec, max_copies=...)",
    "downstream_correction": "downstream=Download(codec, correction=...)",
    "client_dp": "privacy=Privacy(client_dp=...)",
    "local_dp": "privacy=Privacy(local_dp=...)",
    "max_epsilon": "privacy=Privacy(max_epsilon=...)",
    "client_sampling": "sampling=PoissonSampling(rate)",
    "seed": "sampling=PoissonSampling(rate, seed)",
    "max_num_examples": "admission=Admission(max_num_examples=...)",
    "require_compression": "admission=Admission(require_compression=...)",
}


def check_codec_params(params: dict[str, Any]) -> None:
    """``TypeError`` for a keyword argument of `CONCERN_SETTINGS` among the codec parameters, saying
    which concern's object takes it."""
    misplaced = [name for name in params if name in CONCERN_SETTINGS]
    if misplaced:
        raise TypeError("CompressedStrategy: " + "; ".join(
            f"{name!r} is a setting of its concern: pass {CONCERN_SETTINGS[name]}" for name in misplaced))


@dataclass
class Concerns:
    """The concerns of one strategy, built by `compose`.

    Attributes
    ----------
    admission : Admission
    privacy : Privacy
    sampling : PoissonSampling or None
    download : Download
        As resolved (``codec`` never "auto").
    downstream : Downstream or None
        The download's sender (None: the model travels dense).
    ef21 : EF21Aggregate or None
        EF21's server estimate (None: classic error feedback or none).
    hooks : list of RoundHook
        Every concern that sees a round's messages and replies, in calling order.
    """

    admission: Admission
    privacy: Privacy
    sampling: PoissonSampling | None
    download: Download
    downstream: Downstream | None
    ef21: EF21Aggregate | None
    hooks: list[RoundHook]


def compose(inner: Strategy, codec: CodecConfig, download: Download, privacy: Privacy | None,
            sampling: PoissonSampling | None, admission: Admission | None, aggregation: str,
            preset: str | None = None) -> Concerns:
    """Check the concerns against each other and build them.

    Parameters
    ----------
    inner : Strategy
        The wrapped Message-API strategy.
    codec : CodecConfig
        The upload codec.
    download, privacy, sampling, admission, aggregation
        ``CompressedStrategy``'s arguments of those names (None: the concern's defaults).
    preset : str, optional
        Named in the refusal of error feedback under a DP wrapper when it set error feedback.

    Raises
    ------
    TypeError
        ``inner`` not a Message-API strategy; a concern of the wrong type.
    ValueError
        ``aggregation`` not in `AGGREGATIONS`; settings of two concerns that cannot apply together
        (naming both).
    """
    if not isinstance(inner, Strategy):
        raise TypeError(f"inner must be a flwr.serverapp.strategy.Strategy, got {type(inner).__name__}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be 'auto' or 'dense', got {aggregation!r}")
    privacy, admission = _of(privacy, Privacy, "privacy"), _of(admission, Admission, "admission")
    if sampling is not None and not isinstance(sampling, PoissonSampling):
        raise TypeError(f"sampling must be a PoissonSampling or None, got {type(sampling).__name__}")
    try:
        check_feedback_under_dp(codec, inner)
    except ValueError as err:
        raise ValueError(f"preset {preset!r} keeps error feedback: {err}" if preset else str(err)) from None
    if download.codec == "auto":
        auto, density = library_downstream(codec.compressor, download.density, codec.density, privacy.local_dp,
                                           averages_by_weight(inner))
        if download.density is not None and auto not in codecs_with(sparse=True):
            raise ValueError(f"Download(density={download.density!r}) sets a sparse download's density, but "
                             f"downstream='auto' picks {auto!r} for the {codec.compressor!r} upload: pass "
                             f"Download('stc', density={download.density!r}), or no density")
        download = replace(download, codec=auto, density=density)
    for concern in (privacy, sampling, privacy.client_dp):
        if concern is not None and getattr(concern, "in_use", False):
            raise ValueError(f"this {type(concern).__name__} object already serves another CompressedStrategy (its "
                             "accounting or draws belong to that run): give each strategy its own")
    check_sample_rate(privacy, sampling)
    ef21 = None
    if codec.error_feedback == "ef21":
        if sampling is not None:
            raise ValueError("error_feedback='ef21' needs every client in every round: no PoissonSampling (the "
                             "server's single estimate h keeps a departed client's last h_i)")
        ef21 = EF21Aggregate.for_strategy(inner, privacy.client_dp, aggregation)
    why = correction_refusal(download.correction, download.compressed, privacy.client_dp is not None,
                             ef21 is not None, averages_by_weight(inner), aggregation == "dense")
    if why:
        raise ValueError(f"downstream correction = {download.correction!r} cannot apply: {why}")
    downstream = Downstream.for_run(codec, download)
    for concern in (privacy, sampling, privacy.client_dp):
        if concern is not None:
            concern.in_use = True
    hooks: list[RoundHook] = [admission, privacy]
    hooks += [sampling] if sampling is not None else []
    hooks.append(DenseDownload() if downstream is None else DownloadHook(downstream, correct=ef21 is None))
    hooks += [EF21Hook(ef21)] if ef21 is not None else []
    return Concerns(admission, privacy, sampling, download, downstream, ef21, hooks)


def check_sample_rate(privacy: Privacy, sampling: PoissonSampling | None) -> None:
    """Refuse client-level DP accounted at a sampling rate the run does not sample at: epsilon would be
    reported too low (amplification by sampling needs the Poisson sample it assumes).

    Raises
    ------
    ValueError
        ``ClientLevelDP(sample_rate=q < 1)`` without ``PoissonSampling(q)`` at the same rate.
    """
    dp = privacy.client_dp
    if dp is None or dp.sample_rate >= 1.0:
        return  # q = 1: no amplification claimed, whatever the sample
    rate = None if sampling is None else sampling.rate
    if rate != dp.sample_rate:
        got = "no PoissonSampling" if rate is None else f"PoissonSampling({rate:g})"
        raise ValueError(f"ClientLevelDP(sample_rate={dp.sample_rate:g}) accounts for Poisson sampling at that rate, "
                         f"but the strategy has {got}: pass sampling=PoissonSampling({dp.sample_rate:g})")


def _of(value: Any, kind: type, name: str) -> Any:
    """``value``, or ``kind()`` for None; ``TypeError`` naming ``name`` for anything else."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        hint = f" (wrap it: {name}={kind.__name__}(...))" if name == "privacy" else ""
        raise TypeError(f"{name} must be a {kind.__name__} or None, got {type(value).__name__}{hint}")
    return value


__all__ = ["AGGREGATIONS", "CONCERN_SETTINGS", "Concerns", "check_codec_params", "check_sample_rate", "compose"]
