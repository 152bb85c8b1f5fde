"""``CompressedNumPyClient``: compressed updates for a legacy ``flwr.client.NumPyClient``.

For apps still written against Flower's legacy client API (``NumPyClient`` with ``fit``
returning ``(parameters, num_examples, metrics)``, served by ``ClientApp(client_fn=...)``).
The server side is [`fedcomp.strategies.legacy_strategy.LegacyCompressedStrategy`][].

Each payload travels as a 1-D ``uint8`` NumPy array, so Flower's own ndarray serialization
(``np.save`` without pickle) carries its bytes unchanged; only the ``.npy`` header (about
128 bytes per array) is added on the wire.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.client import NumPyClient

from fedcomp.client.update import CompositionError, compress_update, in_position_order
from fedcomp.config import CODEC_DEFAULTS, CodecConfig
from fedcomp.config.codec import check_codec_kwargs
from fedcomp.download.legacy import LAYOUT_KEY, copy_digest_metric, rebuild_legacy
from fedcomp.protocol.messages import RESIDUAL_STATE_KEY

#: ``context.state`` key of the residuals kept by `CompressedNumPyClient` (per array index).
LEGACY_RESIDUAL_STATE_KEY = RESIDUAL_STATE_KEY + ".legacy"


class CompressedNumPyClient(NumPyClient):
    """Wrap a ``NumPyClient`` so that ``fit`` returns compressed updates.

    ``fit`` runs the wrapped client's ``fit``, computes ``delta = returned - received``
    for every array, adds the error-feedback residual of the earlier rounds (Stich et al.
    2018; Karimireddy et al. 2019), compresses with the codec the server asked for and
    returns one payload per array (or one for the whole model with whole-model selection,
    as the Message-API ``compression_mod`` does) as 1-D ``uint8`` arrays. A model that arrives in
    the download's form (`fedcomp.download.legacy`: the server's ``LegacyCompressedStrategy``
    compresses it) is rebuilt from this client's copy before ``fit`` and ``evaluate`` see it, and
    the reply's metrics report the copy's digest. ``get_parameters`` and ``get_properties`` are
    delegated unchanged.

    Parameters
    ----------
    client : NumPyClient
        The application's client; its ``fit`` returns the full trained weights.
    compressor : str, optional
        Force this codec whatever the server asks (like a node-config override in the
        Message API, e.g. ``"sign"`` on a slow link). Default None: use the server's.
    error_feedback : bool, optional
        Force error feedback on or off. Default None: as the server asks.
    state : flwr.app.RecordDict, optional
        Where to keep the residual and the model copy between rounds, typically ``context.state``
        inside ``client_fn(context)``: Flower calls ``client_fn`` for every message, so what is
        kept only on this object would be lost after each round. Default None: on the object
        (enough when the same object serves every round).
    seed : int, optional
        Base seed of stochastic codecs (qsgd, int8, randomk); each ``fit`` call derives
        its own seed from it. Default None: fresh randomness.
    **params
        Further codec settings forced on this client, by their Python or config names
        (``density``, ``levels``, ``block_size``, ``value_dtype``, ``residual_dtype``,
        ``selection``).

    Raises
    ------
    TypeError
        ``client`` is not a ``NumPyClient`` or a parameter name is unknown.
    ValueError
        A forced codec setting is invalid (checked at construction).

    Notes
    -----
    ``fit`` raises `fedcomp.client.CompositionError` when the server sent no codec
    (its strategy is not wrapped in ``LegacyCompressedStrategy``, so nothing could decode
    the payloads) or when the wrapped ``fit`` returns arrays of other number or shapes
    than it received, and ``ValueError`` for a non-finite update (the residual is then
    left unchanged). Flower reports either as a failed client.
    """

    def __init__(self, client: NumPyClient, compressor: str | None = None, error_feedback: bool | None = None,
                 state: RecordDict | None = None, seed: int | None = None, **params: Any) -> None:
        if not isinstance(client, NumPyClient):
            raise TypeError(f"client must be a flwr.client.NumPyClient, got {type(client).__name__}")
        forced = {k.replace("_", "-"): v for k, v in params.items()}
        if compressor is not None:
            forced["compressor"] = compressor
        if error_feedback is not None:
            forced["error-feedback"] = error_feedback
        check_codec_kwargs(forced)
        CodecConfig.from_mapping(forced)  # validate now, not in the middle of a round
        self.client = client
        self.forced = forced
        self.state = state
        #: Where the model copy of the download lives (``state``, else this object's own record).
        self.copy_state = state if state is not None else RecordDict()
        self.seed = seed
        self.calls = 0
        #: Error-feedback residual per array index ("0", "1", ... or the whole-model key).
        self.residuals: dict[str, np.ndarray] = {}
        #: Statistics of the last ``fit`` as ``compress_update`` returned them.
        self.last_stats: dict[str, float] = {}

    # -- delegation -------------------------------------------------------------------
    def get_properties(self, config):
        """Delegate to the wrapped client."""
        return self.client.get_properties(config)

    def get_parameters(self, config):
        """Delegate to the wrapped client (dense weights, e.g. for the server's initial model)."""
        return self.client.get_parameters(config)

    def evaluate(self, parameters, config):
        """Delegate to the wrapped client, on the model rebuilt from the download (`_received`)."""
        parameters, config, digest = self._received(parameters, config)
        loss, num_examples, metrics = self.client.evaluate(parameters, config)
        return loss, num_examples, {**dict(metrics or {}), **digest}

    def _received(self, parameters, config) -> tuple[list, dict, dict]:
        """(the model's arrays, the config without the download's layout, the digest metric): a
        download rebuilt from this client's copy (`fedcomp.download.legacy.rebuild_legacy`), dense
        weights as they came (no digest)."""
        rebuilt = rebuild_legacy(self.copy_state, parameters, config)
        if rebuilt is None:
            return parameters, config, {}
        config = {k: v for k, v in config.items() if k != LAYOUT_KEY}
        return rebuilt, config, copy_digest_metric(self.copy_state)

    # -- the one concern ---------------------------------------------------------------
    def codec(self, config: dict) -> CodecConfig:
        """The codec for this round: the server's keys, then the ones forced on this client.

        Raises
        ------
        CompositionError
            ``config`` carries no ``compressor`` key: the server is not wrapped.
        ValueError
            A codec setting out of range.
        """
        if "compressor" not in config:
            raise CompositionError(
                "the server sent no codec in the fit config: wrap its strategy in "
                "fedcomp.strategies.legacy_strategy.LegacyCompressedStrategy (a plain strategy cannot decode payloads)"
            )
        merged = {k: v for k, v in config.items() if k in CODEC_DEFAULTS}
        merged.update(self.forced)
        return CodecConfig.from_mapping(merged)

    def fit(self, parameters, config):
        """Train with the wrapped client, then return compressed updates.

        Parameters
        ----------
        parameters : list of np.ndarray
            Global weights sent by the server.
        config : dict
            Fit config; holds the codec added by ``LegacyCompressedStrategy``.

        Returns
        -------
        (payloads, num_examples, metrics)
            Payloads as 1-D ``uint8`` arrays; the wrapped client's ``num_examples``; its
            metrics plus the scalar statistics of
            `fedcomp.client.compress_update`: ``upload-bytes`` (payload bytes),
            ``dense-bytes`` (fp32 cost), ``compression-error``, ``residual-norm``, ...
            (all of them, lists included, are in `last_stats`).
        """
        codec = self.codec(config)
        parameters, config, digest = self._received(parameters, config)
        received = {str(i): np.asarray(p) for i, p in enumerate(parameters)}
        trained_list, num_examples, metrics = self.client.fit(parameters, config)
        if len(trained_list) != len(received):
            raise CompositionError(
                f"the wrapped fit returned {len(trained_list)} arrays for {len(received)} received: "
                "it must return the full model in the received order"
            )
        trained = {str(i): np.asarray(t) for i, t in enumerate(trained_list)}
        payloads, new_res, stats = compress_update(received, trained, codec, self._load_residuals(), self._next_seed())
        self._store_residuals(new_res if codec.error_feedback else {})
        self.last_stats = stats
        out = [np.frombuffer(payloads[k], dtype=np.uint8).copy() for k in in_position_order(payloads)]
        # legacy metrics are scalars only (Flower's compat layer rejects lists, e.g. per-layer stats)
        scalars = {k: v for k, v in stats.items() if isinstance(v, (bool, int, float, str, bytes))}
        return out, num_examples, {**dict(metrics or {}), **scalars, **digest}

    # -- state ---------------------------------------------------------------------------
    def _next_seed(self) -> int | None:
        self.calls += 1
        if self.seed is None:
            return None
        digest = hashlib.sha256(f"{self.seed}:{self.calls}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def _load_residuals(self) -> dict[str, np.ndarray]:
        if self.state is not None and LEGACY_RESIDUAL_STATE_KEY in self.state:
            return {k: a.numpy() for k, a in self.state[LEGACY_RESIDUAL_STATE_KEY].items()}
        return self.residuals

    def _store_residuals(self, residuals: dict[str, np.ndarray]) -> None:
        self.residuals = residuals
        if self.state is not None:
            self.state[LEGACY_RESIDUAL_STATE_KEY] = ArrayRecord({k: Array(v) for k, v in residuals.items()})


__all__ = ["LEGACY_RESIDUAL_STATE_KEY", "CompressedNumPyClient"]
