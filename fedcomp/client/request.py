"""What one train message asks of this node, read once: the codec (node config may override),
local-DP settings checked against the node's own floor, Flower's client-side clipping norm, the
round and the seed of stochastic codecs (downstream model versions are read by
`fedcomp.download.receiver.rebuild`, which owns them)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, Context, Message, RecordDict

from fedcomp.client.update import CompositionError
from fedcomp.config import CODEC_DEFAULTS, KEYS, CodecConfig
from fedcomp.privacy import LocalDP
from fedcomp.util.validate import closest_hint


def only_record(content: RecordDict, kind: str) -> tuple[str, Any]:
    """The one ``kind`` ("array" or "config") record of ``content``, with its key.

    Raises
    ------
    CompositionError
        Not exactly one such record.
    """
    recs = content.array_records if kind == "array" else content.config_records
    if len(recs) != 1:
        raise CompositionError(f"compression_mod expects exactly one {kind} record in the message, found {len(recs)}")
    return next(iter(recs.items()))


def train_config(content: RecordDict) -> dict:
    """The entries of a train message's ConfigRecord ({} when it has none).

    Other mods may add ConfigRecords of their own; then the train config is the one record that
    carries a codec key (`fedcomp.config.CODEC_DEFAULTS`) or ``server-round``.

    Raises
    ------
    CompositionError
        Several ConfigRecords, and not exactly one of them carries those keys.
    """
    recs = content.config_records
    if len(recs) <= 1:
        return dict(next(iter(recs.values()), {}))
    marked = [k for k, rec in recs.items() if "server-round" in rec or any(k2 in rec for k2 in CODEC_DEFAULTS)]
    if len(marked) != 1:
        raise CompositionError(f"compression_mod cannot tell the train config among the message's ConfigRecords "
                               f"{sorted(recs)}: {len(marked)} of them carry codec keys or 'server-round' "
                               f"({marked}), expected exactly one")
    return dict(recs[marked[0]])


@dataclass
class TrainRequest:
    """One train message, parsed.

    Attributes
    ----------
    config : dict
        The train ConfigRecord's entries (`train_config`).
    array_key : str
        Key of the message's ArrayRecord.
    arrays : ArrayRecord
        As received: dense weights, or a downstream payload record.
    server_round : int
        ``server-round`` (0 if absent).
    codec : CodecConfig
        The codec the server asked for, node-config keys of the same names applied over it.
    seed : int
        Seed of stochastic codecs: a hash of run seed, partition (or node id) and round. Never
        used for privacy noise.
    local_dp : LocalDP or None
        Local DP the server asked for (never below the node's own floor).
    clipping_norm : float or None
        Flower's client-side ``clipping_norm`` in the train config, if any.
    """

    config: dict
    array_key: str
    arrays: ArrayRecord
    server_round: int
    codec: CodecConfig
    seed: int
    local_dp: LocalDP | None
    clipping_norm: float | None

    @classmethod
    def parse(cls, msg: Message, context: Context) -> TrainRequest:
        """Read ``msg`` (a train message) in the node's ``context``.

        Raises
        ------
        CompositionError
            Not exactly one ArrayRecord, or no one train config among several ConfigRecords
            (`train_config`).
        ValueError
            A codec key out of range, an unknown ``dp`` mode in the node's or run config, or
            local DP below the node's own floor (the client refuses to train; Flower sends an
            error reply).
        """
        config = train_config(msg.content)
        codec = _codec(config, context)
        array_key, arrays = only_record(msg.content, "array")
        rnd = config.get("server-round", 0)
        rnd = int(rnd) if isinstance(rnd, (int, float)) and not isinstance(rnd, bool) else 0
        clip = config.get("clipping_norm")
        clip = None if isinstance(clip, bool) or not isinstance(clip, (int, float)) else float(clip)
        return cls(config, array_key, arrays, rnd, codec, _stream_seed(context, rnd), _local_dp(config, context),
                   clip)


def _codec(config: dict, context: Context) -> CodecConfig:
    merged = {k: v for k, v in config.items() if k in CODEC_DEFAULTS}
    node = {k: v for k, v in context.node_config.items() if k in CODEC_DEFAULTS}
    sent_ef, own_ef = config.get("error-feedback", CODEC_DEFAULTS["error-feedback"]), node.get("error-feedback")
    if "error-feedback" in node and own_ef != sent_ef and "ef21" in (own_ef, sent_ef):
        # EF21 pairs every client's h_i with the server's estimate h: a client on another EF mode corrupts h
        raise ValueError(f"node config 'error-feedback' = {own_ef!r} differs from the server's {sent_ef!r}: "
                         "error-feedback cannot be overridden per node when either side is 'ef21'")
    merged.update(node)
    return CodecConfig.from_mapping(merged, source="train/node config")


def _stream_seed(context: Context, server_round: int) -> int:
    node = context.node_config.get("partition-id", context.node_id)
    key = f"{context.run_config.get('seed', 0)}:{node}:{server_round}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def own_local_dp(context: Context) -> LocalDP | None:
    """This client's own local-DP floor: node config ``dp = "local"`` (with its ``noise-multiplier``
    and ``clipping-norm``), else the run config's; None if neither asks for local DP.

    Raises
    ------
    ValueError
        A ``dp`` value that is not one of the declared modes (``"Local"``, ``"locl"``):
        the client refuses rather than train with its privacy floor silently off."""
    modes = KEYS["dp"].choices
    for where, cfg in (("node config", context.node_config), ("run config", context.run_config)):
        if "dp" in cfg and cfg["dp"] not in modes:  # a slip ("Local") must not switch the privacy floor off
            raise ValueError(f"{where} 'dp' must be one of {list(modes)}, got {cfg['dp']!r} "
                             f"({closest_hint(cfg['dp'], modes, 'mode')}); this client does not train with an "
                             "unknown privacy setting")
        if cfg.get("dp") == "local":
            return LocalDP(cfg.get("clipping-norm", KEYS["clipping-norm"].default),
                           cfg.get("noise-multiplier", KEYS["noise-multiplier"].default))
        if "dp" in cfg:
            return None
    return None


def _local_dp(config: dict, context: Context) -> LocalDP | None:
    """The server's local-DP request, checked against this client's own floor: the privacy of a
    Gaussian release depends on the noise multiplier alone, so the server may pick the clipping
    norm, but never a noise multiplier below the client's own."""
    server = (LocalDP(config["local-dp-clipping-norm"], config.get("local-dp-noise-multiplier", 0.0))
              if "local-dp-clipping-norm" in config else None)
    own = own_local_dp(context)
    if own is not None and (server is None or server.noise_multiplier < own.noise_multiplier):
        asked = "no local DP" if server is None else f"noise multiplier {server.noise_multiplier}"
        raise ValueError(f"privacy floor: this client's config sets dp = 'local' with noise multiplier "
                         f"{own.noise_multiplier}, the server asked for {asked}; the client does not train")
    return server
