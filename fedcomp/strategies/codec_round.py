"""The codec a round asks clients for: checks of the model at round 1 and of the codec against the
inner strategy, and the train config keys.

The codec itself and its per-round schedule (warm-up, density ramp) are
`fedcomp.config.CodecConfig`'s; this module only puts them into a train ConfigRecord.
"""

from __future__ import annotations

from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log

from fedcomp.config import CODEC_DEFAULTS, CodecConfig, model_policy
from fedcomp.protocol.messages import LAYER_REPORT_KEY, MODEL_KEY
from fedcomp.strategies.wrapping import wraps


def check_model(codec: CodecConfig, arrays: ArrayRecord) -> None:
    """First-round checks of the global model against the codec; logs the per-model defaults once.

    Raises
    ------
    ValueError
        A per-tensor rule names no tensor of the model, or a tensor is named ``MODEL_KEY`` (the
        name the whole-model payload travels under).
    """
    codec.check_rules_match(list(arrays.keys()))
    note = model_policy.describe(arrays.keys(), {k: int(np.prod(a.shape)) for k, a in arrays.items()}, codec)
    if note:
        log(INFO, "%s", note)
    if MODEL_KEY in arrays:
        raise ValueError(f"the model has a tensor named '{MODEL_KEY}', the name fedcomp's whole-model payload "
                         "travels under: rename that module or parameter")


def check_feedback_under_dp(codec: CodecConfig, inner: Any) -> None:
    """Refuse error feedback under Flower's client-side clipping (a wrapper in ``inner``'s chain).

    Raises
    ------
    ValueError
        ``codec`` keeps a residual and ``inner`` wraps a ``DifferentialPrivacyClientSide*`` strategy.
    """
    if codec.error_feedback and wraps(inner, "DifferentialPrivacyClientSide"):
        raise ValueError(
            "error feedback with Flower's client-side clipping breaks the DP guarantee: the residual makes the sent "
            "update's norm exceed clipping_norm from round 2 on, while the server's noise assumes it does not. Use "
            "error_feedback=False, or server-side clipping of the decoded update "
            "(DifferentialPrivacyServerSideFixedClipping inside CompressedStrategy, or client_dp=ClientLevelDP(...))")


#: Rounds in which the train config asks clients for their per-layer figures (``layer-update-norm``,
#: ``layer-compression-error``): round 1 and every this many rounds (diagnostics, not needed to aggregate;
#: two float64 lists per reply cost more than a sparse payload of a small model).
LAYER_REPORT_EVERY = 10


def codec_entries(codec: CodecConfig, server_round: int) -> dict[str, Any]:
    """The train-config entries of the codec in force in ``server_round``: ``compressor`` and every key
    whose value differs from its default (`fedcomp.config.CODEC_DEFAULTS`); the client reads an
    absent key as its default, so the message carries what it must and nothing more. In round 1 and
    every `LAYER_REPORT_EVERY` rounds, `LAYER_REPORT_KEY` asks
    the clients for their per-layer figures.

    An empty string is never sent (``layer-codecs = ""`` is the default): flwr 1.42's
    ``ConfigRecord.count_bytes`` raises ``ValueError`` on one, so Flower's ``message_size_mod`` could
    not count the message.
    """
    entries = {k: v for k, v in codec.for_round(server_round).to_mapping().items()
               if k == "compressor" or (v != CODEC_DEFAULTS[k] and v != "")}
    if server_round == 1 or server_round % LAYER_REPORT_EVERY == 0:
        entries[LAYER_REPORT_KEY] = True
    return entries


def add_codec(codec: CodecConfig, server_round: int, config: ConfigRecord) -> None:
    """Write `codec_entries` of ``server_round`` into ``config`` (Flower passes the same train config
    every round: the codec keys of an earlier round are removed first)."""
    for k in [k for k in config if k in CODEC_DEFAULTS or k == LAYER_REPORT_KEY]:
        del config[k]
    for k, v in codec_entries(codec, server_round).items():
        config[k] = v


__all__ = ["LAYER_REPORT_EVERY", "add_codec", "check_feedback_under_dp", "check_model", "codec_entries"]
