"""What travels between the client mod and the server strategy (Flower-level names, no codecs):
message keys and the payload ``Array`` (``messages``), the error of a message that cannot be handled as
composed (``errors``) and the client's device report (``device``). The download's own layout is in
`fedcomp.download`.

The names of ``messages`` are re-exported here (``from fedcomp.protocol import payload_array``).
"""

from fedcomp.protocol.messages import (
    BASE_VERSION,
    COPY_RECORD,
    DEFAULT_DOWNLINK_MBPS,
    DEFAULT_UPLINK_MBPS,
    ESTIMATE_ROUND_METRIC,
    MIN_LINK_MBPS,
    MODEL_KEY,
    MODEL_META_KEY,
    MODEL_STATE_KEY,
    MODEL_VERSION,
    PAYLOAD_DTYPE,
    PAYLOAD_STYPE,
    RESIDUAL_ROUND_KEY,
    RESIDUAL_STATE_KEY,
    SECAGG_DDP_NOISE_KEY,
    SECAGG_DP_CLIP_KEY,
    SECAGG_KEYS_KEY,
    SECAGG_PACK_KEY,
    SECAGG_ROTATION_KEY,
    SECAGG_SEED_KEY,
    payload_array,
    server_round,
)

__all__ = [
    "BASE_VERSION",
    "COPY_RECORD",
    "DEFAULT_DOWNLINK_MBPS",
    "DEFAULT_UPLINK_MBPS",
    "ESTIMATE_ROUND_METRIC",
    "MIN_LINK_MBPS",
    "MODEL_KEY",
    "MODEL_META_KEY",
    "MODEL_STATE_KEY",
    "MODEL_VERSION",
    "PAYLOAD_DTYPE",
    "PAYLOAD_STYPE",
    "RESIDUAL_ROUND_KEY",
    "RESIDUAL_STATE_KEY",
    "SECAGG_DDP_NOISE_KEY",
    "SECAGG_DP_CLIP_KEY",
    "SECAGG_KEYS_KEY",
    "SECAGG_PACK_KEY",
    "SECAGG_ROTATION_KEY",
    "SECAGG_SEED_KEY",
    "payload_array",
    "server_round",
]
