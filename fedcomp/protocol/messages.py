"""Names shared by the client mod and the server strategy (the Flower-level protocol).

A compressed train reply carries one ArrayRecord whose keys are the model's parameter
names and whose Arrays hold fedcomp payloads as raw bytes:
``Array(dtype="bytes", shape=(len(payload),), stype=PAYLOAD_STYPE, data=payload)``, so
``len(Array.data)`` is exactly the payload size in bytes (`payload_array`).
"""

from flwr.app import Array

#: ``Array.stype`` of a fedcomp payload.
PAYLOAD_STYPE = "fedcomp.payload.v1"
#: ``Array.dtype`` of a fedcomp payload.
PAYLOAD_DTYPE = "bytes"
#: Key in ``context.state`` of the error-feedback residuals (an ArrayRecord, one per parameter).
RESIDUAL_STATE_KEY = "fedcomp.residual"
#: Key in ``context.state`` of the round the kept residuals were computed in (``{"round": int}``).
RESIDUAL_ROUND_KEY = "fedcomp.residual-round"
#: Reply metric under EF21: the server round of the last send the client's estimate ``h_i`` holds (0:
#: none); the server refuses a node whose value is not the round it last folded (`fedcomp.strategies.ef21_aggregate`).
ESTIMATE_ROUND_METRIC = "ef21-estimate-round"
#: The metric keys ``compression_mod`` adds to a train reply's MetricRecord (bytes, compression error,
#: residual, timings, the device's memory and link report, per-layer lists, EF21's estimate round).
#: The server reads them into its per-client figures and keeps them out of the records that the inner
#: strategy averages, so that a Flower app's own round metrics hold its own keys.
REPORT_KEYS = frozenset({
    "upload-bytes", "dense-bytes", "download-bytes", "compression-error", "density", "residual-norm",
    "residual-bytes", "residual-saturated", "residual-saturated-loss", "compress-seconds", "clientapp-seconds",
    "client-peak-rss-mb", "client-memory-limit-mb", "client-oom-kills", "uplink-mbps", "downlink-mbps",
    "layer-update-norm", "layer-compression-error", ESTIMATE_ROUND_METRIC})
#: Train-config key with which the server asks for the per-layer figures (``layer-update-norm``,
#: ``layer-compression-error``); without it a reply leaves them out.
LAYER_REPORT_KEY = "fedcomp-report-layers"
#: The report figures a reply leaves out when they hold the value the server assumes for a missing one
#: (0, or the default link speeds), and the bytes the server counts itself from what it sent and received.
LEAN_DEFAULTS = {"residual-saturated": 0.0, "residual-saturated-loss": 0.0, "client-memory-limit-mb": 0.0,
                 "client-oom-kills": 0.0, "clientapp-seconds": 0.0, "upload-bytes": None,
                 "dense-bytes": None, "download-bytes": None}
#: ArrayRecord key of a whole-model payload (selection scope "model"): the update of every
#: parameter, flattened in the global model's key order and concatenated.
MODEL_KEY = "fedcomp.model"
#: Keys in ``context.state`` of the client's model copy (downstream compression) and its version.
MODEL_STATE_KEY = "fedcomp.model-copy"
MODEL_META_KEY = "fedcomp.model-version"
#: Link speeds (megabits per second) of a node that declares none (node config ``uplink-mbps`` /
#: ``downlink-mbps``): a slow uplink, a faster downlink, as on most access links.
DEFAULT_UPLINK_MBPS = 1.0
DEFAULT_DOWNLINK_MBPS = 10.0
#: Slowest link speed (megabits per second) accepted in a config or used for a reported speed
#: (1 bit/s); a smaller positive speed (e.g. 1e-310) would make a client's simulated seconds inf.
MIN_LINK_MBPS = 1e-6
#: Train-config keys of downstream compression: the model version a client will hold after this
#: message, and (payload messages only) the version the payload applies to.
MODEL_VERSION = "fedcomp-model-version"
BASE_VERSION = "fedcomp-base-version"
#: ConfigRecord of a reply to a versioned download (train or evaluate): ``"digest"``, a digest of the model
#: copy the node holds (8 bytes, `fedcomp.download.layout.copy_digest`), which the server compares with
#: its record of that copy.
COPY_RECORD = "fedcomp.copy"


def server_round(msg) -> int:
    """The ``server-round`` a Flower strategy put in the message's ConfigRecord (0 if absent).

    Parameters
    ----------
    msg : flwr.app.Message
        A message with content.
    """
    recs = msg.content.config_records
    if not recs:
        return 0
    value = next(iter(recs.values())).get("server-round", 0)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

#: Train-config keys of shared-randomness encoding under SecAgg+ (``fedcomp.secagg``): the round's
#: shared seed (its presence tells ``compression_mod`` that the secure-aggregation mod encodes this
#: update), the model's parameter names, the rotation flag and whether masked vectors may be packed.
SECAGG_SEED_KEY = "fedcomp-secagg-seed"
SECAGG_KEYS_KEY = "fedcomp-secagg-keys"
SECAGG_ROTATION_KEY = "fedcomp-secagg-rotation"
SECAGG_PACK_KEY = "fedcomp-secagg-pack"
#: Client-level DP under SecAgg+: the L2 bound every client clips its k selected values to.
SECAGG_DP_CLIP_KEY = "fedcomp-secagg-dp-clip"
#: Distributed DP under SecAgg+: the noise multiplier z; each client adds its share of Skellam noise so
#: that a sum of threshold-many shares has std z * clip per value.
SECAGG_DDP_NOISE_KEY = "fedcomp-secagg-ddp-noise"
#: Per-node train-config key: the last round whose applied secure sum included this node's masked vector
#: (0: none). The client commits the error-feedback residual of that round and rolls back a later one.
SECAGG_APPLIED_KEY = "fedcomp-secagg-applied-round"

def payload_array(payload: bytes) -> Array:
    """A fedcomp payload as a Flower ``Array``: raw bytes, ``len(Array.data) == len(payload)``."""
    return Array(dtype=PAYLOAD_DTYPE, shape=(len(payload),), stype=PAYLOAD_STYPE, data=payload)
