"""``LegacyCompressedStrategy``: compressed updates for Flower's legacy strategy API.

For servers still written against ``flwr.server.strategy`` (``configure_fit`` /
``aggregate_fit`` with ``Parameters``), run through ``ServerApp(server_fn=...)`` or the
deprecated ``flwr.simulation.start_simulation``. Clients use
[`fedcomp.client.numpy_client.CompressedNumPyClient`][] (payloads as 1-D ``uint8`` arrays), or
a legacy ``ClientApp(client_fn=..., mods=[compression_mod])`` (payloads as raw tensors of
type ``fedcomp.payload.v1``); this wrapper decodes both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from logging import INFO, WARNING

import numpy as np
from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.logger import log
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi, Strategy

from fedcomp.compression import PayloadError
from fedcomp.config import CodecConfig
from fedcomp.download.legacy import LegacyDownload
from fedcomp.download.options import Download
from fedcomp.download.sender import Downstream
from fedcomp.statedict import FlatModel
from fedcomp.statedict.tied import find_tied, tie_list
from fedcomp.strategies.admission import admit, check_max_num_examples, check_weight
from fedcomp.strategies.codec_round import codec_entries
from fedcomp.strategies.failures import MAX_REFUSAL_CHARS, printable
from fedcomp.strategies.forward import ForwardsToInner
from fedcomp.strategies.legacy_decode import decode_legacy_update, payloads_from_parameters
from fedcomp.strategies.legacy_wire import LegacyWire
from fedcomp.strategies.presets import library_downstream
from fedcomp.strategies.round_metrics import client_stats, upload_metrics

#: What a client that reports no model copy most likely lacks.
NO_COPY_HINT = ("wrap it in fedcomp.client.numpy_client.CompressedNumPyClient or run compression_mod on it, or "
                "pass downstream='none' to send the model dense")
#: Flower's legacy strategies that aggregate by a weighted mean of the results' weights.
_LEGACY_MEANS = (FedAvg, FedAvgM, FedProx, FedAdam, FedAdagrad, FedYogi)


def legacy_weighted_mean(strategy: Strategy) -> bool:
    """Whether a legacy ``strategy`` aggregates by a weighted mean of the clients' weights (one of
    `_LEGACY_MEANS`, or a subclass that keeps its ``aggregate_fit``): then the global model it returns is
    built from the clients' updates alone, and the clients may train from compressed copies of it."""
    cls = type(strategy)
    base = next((b for b in cls.__mro__ if b in _LEGACY_MEANS), None)
    return base is not None and cls.aggregate_fit is base.aggregate_fit


@dataclass
class LegacySentRound:
    """What ``configure_fit`` sent in one round: the global arrays each client (by ``cid``) got."""

    server_round: int
    arrays: dict[str, list[np.ndarray]]


class LegacyCompressedStrategy(ForwardsToInner, Strategy):
    """Wrap a legacy ``flwr.server.strategy.Strategy`` so that clients send compressed updates.

    The legacy-API counterpart of [`fedcomp.strategies.CompressedStrategy`][]; it adds
    one concern and delegates the rest:

    1. ``configure_fit``: adds the codec (``compressor``, ``density``, ``levels``,
       ``block-size``, ``value-dtype``, ``error-feedback``, ``residual-dtype``,
       ``selection``) to every client's ``FitIns.config`` and remembers the parameters
       each client was sent.
    2. ``aggregate_fit``: reads each ``FitRes``' payloads (`payloads_from_parameters`),
       decodes and validates them (`decode_legacy_update`: element cap and shape per
       array, finiteness), replaces the ``FitRes`` parameters by the dense weights
       ``global + delta`` and hands ordinary results to the wrapped strategy. A result that
       fails to decode is logged with the client's ``cid`` and moved to ``failures``, so
       the wrapped strategy's own policy applies (FedAvg with ``accept_failures=False``
       then skips the round).
    3. Adds round metrics to what the wrapped strategy returns, and to `history`:
       ``upload-bytes`` (payload bytes received, without the ``.npy`` headers Flower adds),
       ``dense-bytes``, ``compression-ratio``, ``compression-error`` (mean of the clients'
       reports), ``num-replies``, ``rejected-replies``, ``failed-clients`` and
       ``upload-bytes-<codec>`` (`fedcomp.strategies.round_metrics.upload_metrics`).

    4. The model travels compressed both ways (``downstream``, `fedcomp.download.legacy`): each
       ``FitIns`` and ``EvaluateIns`` carries the step that brings the client's copy to the global
       model (a first contact to a client without one), as 1-D ``uint8`` arrays and a layout in the
       config; the client (``CompressedNumPyClient``, or ``compression_mod`` in a legacy ClientApp)
       rebuilds the model and reports its copy's digest.

    ``initialize_parameters`` and ``evaluate`` are delegated unchanged.

    Parameters
    ----------
    strategy : flwr.server.strategy.Strategy
        Any legacy strategy: FedAvg, FedProx, FedAdam, FedMedian, Flower's legacy DP
        wrappers, ... It only ever receives dense, validated results. Held as `inner`
        (as ``CompressedStrategy`` names it; ``.strategy`` reads the same object).
    compressor : str
        Codec name (see `fedcomp.compression.available_compressors`). Default "stc".
    error_feedback : bool
        Clients keep a residual (Stich et al. 2018; Karimireddy et al. 2019). Default True.
    max_num_examples : int
        Largest ``num_examples`` (FedAvg's weight) a result may claim; a result claiming
        fewer than 1 or more is rejected, so that one client cannot dictate the weighted
        mean. Default 10**9.
    downstream : Download or str or None
        The download (`fedcomp.download.Download`; a string is its codec, None or "none" dense).
        Default "auto": the upload codec's counterpart with server-side error feedback, as
        ``CompressedStrategy``'s (`fedcomp.strategies.presets.library_downstream`); dense for
        ``compressor="none"`` and for inner strategies other than a weighted mean (FedMedian,
        Krum, Flower's DP wrappers: `legacy_weighted_mean`). Needs fedcomp on every client.
    **params
        Codec parameters by their Python or config names: ``density``, ``levels``,
        ``block_size``, ``value_dtype``, ``residual_dtype``, ``selection``.

    Raises
    ------
    TypeError
        ``strategy`` is not a legacy ``Strategy`` (a Message-API one needs
        ``CompressedStrategy``), or an unknown parameter name.
    ValueError
        Unknown codec or a parameter out of range.

    Notes
    -----
    ``aggregate_fit`` raises ``RuntimeError`` when called for a round that
    ``configure_fit`` did not configure.

    Sources: the legacy ``Strategy`` interface of Flower (``flwr.server.strategy``,
    https://flower.ai/docs/framework/ref-api/flwr.server.strategy.Strategy.html); wrapper
    structure after Flower's DP strategy wrappers; codecs and error feedback as in
    `fedcomp.compression`.
    """

    def __init__(self, strategy: Strategy, compressor: str = "stc", error_feedback: bool = True,
                 max_num_examples: int = 10**9, *, downstream: Download | str | None = "auto", **params) -> None:
        if not isinstance(strategy, Strategy):
            hint = " (use fedcomp.strategies.CompressedStrategy for flwr.serverapp strategies)"
            raise TypeError(f"strategy must be a flwr.server.strategy.Strategy, got {type(strategy).__name__}{hint}")
        super().__init__()
        self.inner = strategy
        self.codec = CodecConfig.from_kwargs(compressor, error_feedback, **params)
        if self.codec.error_feedback == "ef21":
            raise ValueError("error_feedback='ef21' needs the server's estimate: "
                             "use fedcomp.strategies.CompressedStrategy")
        self.max_num_examples = check_max_num_examples(max_num_examples)
        download = Download.of(downstream)
        if download.codec == "auto":
            codec, density = library_downstream(self.codec.compressor, download.density, self.codec.density, None,
                                                legacy_weighted_mean(strategy))
            download = replace(download, codec=codec, density=density)
        sender = Downstream.for_run(self.codec, download)
        #: The download (None: the model travels dense).
        self.download: LegacyDownload | None = None if sender is None else LegacyDownload(sender)
        #: The arrays sent in the current round (set by `configure_fit`).
        self.sent_round: LegacySentRound | None = None
        #: Per-round metrics computed by this wrapper (round -> dict); ``wire-bytes-*`` (`legacy_wire`): every
        #: instruction and result serialised as Flower's compatibility layer sends it, evaluation included.
        self.history: dict[int, dict[str, float]] = {}
        self.wire = LegacyWire()
        self._plain_model: Parameters | None = None
        #: Positions (``"0"``, ``"1"``, ...) holding one tensor, tied in every aggregate (None: found in
        #: the first parameters sent; [] ties none: `fedcomp.statedict.tied.find_tied`).
        self.tied_groups: list[tuple[str, ...]] | None = None
        self._start_forwarding()  # from here on, settings of the wrapped strategy reach it (`forward`)

    _INNER_NAMED = ".inner (or .strategy)"

    @property
    def strategy(self) -> Strategy:
        """The wrapped legacy strategy (read-only; the same object as `inner`)."""
        return self.inner

    def __repr__(self) -> str:
        return f"LegacyCompressedStrategy({self.inner!r}, {self.codec.describe()})"

    # -- delegation -------------------------------------------------------------------
    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        """Delegate unchanged."""
        log(INFO, "LegacyCompressedStrategy: %s", self.codec.describe())
        return self.inner.initialize_parameters(client_manager)

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[tuple[ClientProxy, EvaluateIns]]:
        """Delegate; each client's model in its download form (`fedcomp.download.legacy`)."""
        instructions = list(self.inner.configure_evaluate(server_round, parameters, client_manager))
        out = instructions if self.download is None else self.download.instructions(server_round, instructions,
                                                                                      "evaluate")
        self.wire.sent(server_round, "evaluate", out, instructions)
        return out

    def aggregate_evaluate(self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]],
                           failures: list) -> tuple[float | None, dict[str, Scalar]]:
        """Count the results, note what each client holds (the digest leaves its metrics), then delegate."""
        self.wire.received(server_round, "evaluate", results, None)
        if server_round in self.history:
            self.history[server_round].update(self.wire.count.get(server_round))
        if self.download is not None:
            results, failures = self._note_copies(server_round, results, failures)
        return self.inner.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """Delegate unchanged."""
        return self.inner.evaluate(server_round, parameters)

    # -- the one concern ---------------------------------------------------------------
    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        """Delegate, then add the round's codec (warm-up, scheduled density) to every ``FitIns.config``
        and remember what each client gets."""
        instructions = self.inner.configure_fit(server_round, parameters, client_manager)
        codec = codec_entries(self.codec, server_round)
        decoded: dict[int, list[np.ndarray]] = {}  # FedAvg sends one Parameters object to all: decode it once
        sent: dict[str, list[np.ndarray]] = {}
        out = []
        for proxy, ins in instructions:
            key = id(ins.parameters)
            if key not in decoded:
                decoded[key] = [a.copy() for a in parameters_to_ndarrays(ins.parameters)]
            sent[proxy.cid] = decoded[key]
            out.append((proxy, FitIns(ins.parameters, {**ins.config, **codec})))
        self.sent_round = LegacySentRound(server_round, sent)
        if self.tied_groups is None:
            arrays = parameters_to_ndarrays(parameters)  # tied parameters sent as two arrays: kept tied
            self.tied_groups = find_tied(FlatModel.from_numpy({str(i): a for i, a in enumerate(arrays)}))
        if self.download is not None:
            out = self.download.instructions(server_round, out, "train")
        self.wire.sent(server_round, "train", out, instructions)
        self._plain_model = instructions[0][1].parameters if instructions else None
        return out

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Decode every result, drop the bad ones into ``failures``, delegate the dense ones."""
        sent = self.sent_round
        if sent is None or sent.server_round != server_round:
            raise RuntimeError(f"aggregate_fit for round {server_round} without configure_fit")
        failures = list(failures)
        n_failed = len(failures)
        self.wire.received(server_round, "train", results, self._plain_model)
        if self.download is not None:
            results, failures = self._note_copies(server_round, results, failures)
        results, refused = admit(results, lambda r: r[0].cid, set(sent.arrays))
        for (proxy, res), why in refused:
            log(WARNING, "round %s: rejected fit result from client %s: %s", server_round, proxy.cid, why)
            failures.append((proxy, res))
        good: list[tuple[ClientProxy, FitRes]] = []
        stats: list[dict] = []
        codec_bytes: dict[str, int] = {}
        for proxy, res in results:
            try:
                check_weight(res.num_examples, "num_examples", self.max_num_examples)
                weights, info = decode_legacy_update(payloads_from_parameters(res.parameters), sent.arrays[proxy.cid])
            except (PayloadError, ValueError, TypeError, KeyError) as exc:
                log(WARNING, "round %s: rejected fit result from client %s: %s", server_round, proxy.cid,
                    printable(exc, MAX_REFUSAL_CHARS))
                failures.append((proxy, res))
                continue
            for name, nbytes in info["codecs"].items():
                codec_bytes[name] = codec_bytes.get(name, 0) + nbytes
            stats.append(client_stats(proxy.cid, res.metrics or {}, info["upload-bytes"],
                                      sum(4 * w.size for w in weights), 0.0))
            weights = tie_list(weights, self.tied_groups or ())
            dense_res = FitRes(status=res.status, parameters=ndarrays_to_parameters(weights),
                               num_examples=res.num_examples, metrics=res.metrics)
            good.append((proxy, dense_res))
        parameters, metrics = self.inner.aggregate_fit(server_round, good, failures)
        if parameters is not None and self.tied_groups:
            parameters = ndarrays_to_parameters(tie_list(parameters_to_ndarrays(parameters), self.tied_groups))
        ours = upload_metrics(stats, codec_bytes, len(good), len(failures) - n_failed, n_failed)
        ours["download-bytes"] = float(sum(self.download.sent_bytes.values()) if self.download is not None else
                                       sum(4 * a.size for arrays in sent.arrays.values() for a in arrays))
        ours.update(self.wire.count.get(server_round))
        self.history[server_round] = ours
        return parameters, {**dict(metrics or {}), **ours}

    def _note_copies(self, server_round: int, results: list, failures: list) -> tuple[list, list]:
        """The download's record of what each client holds (`LegacyDownload.note`), resyncs logged; the
        results of clients that report no copy move to ``failures`` (a client without fedcomp read the
        download's bytes as its model). Returns (results, failures)."""
        unread = self.download.note(results, failures)
        resynced = self.download.downstream.resynced
        if resynced:
            log(WARNING, "round %s: the model copy of client(s) %s differs from the server's record of it; they get "
                "a first contact next time", server_round, sorted(resynced))
            resynced.clear()
        if unread:
            log(WARNING, "round %s: client(s) %s were sent the compressed model and report no copy of it (no "
                "fedcomp on the node? its result is left out): %s", server_round, sorted(unread), NO_COPY_HINT)
        return ([r for r in results if r[0].cid not in unread],
                list(failures) + [r for r in results if r[0].cid in unread])


__all__ = ["LegacyCompressedStrategy", "legacy_weighted_mean"]
