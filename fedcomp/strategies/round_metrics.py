"""Round and per-client metrics of ``CompressedStrategy`` (bytes, ratios, simulated round time, per
layer), computed from untrusted client reports: non-numbers and non-finite values count as default."""

from __future__ import annotations

import statistics

import numpy as np
from flwr.app import MetricRecord, RecordDict

from fedcomp.protocol.device import MEMORY_REPORT_KEYS, implausible_memory_report
from fedcomp.protocol.messages import DEFAULT_DOWNLINK_MBPS, DEFAULT_UPLINK_MBPS, MIN_LINK_MBPS

#: Mean seconds a deployed round waits on Flower's polling (flwr 1.42): a SuperNode with no work asks
#: the SuperLink again after 3 s (``flwr/supernode/start_client_internal.py``) and the ServerApp's
#: grid looks for replies every 3 s (``flwr/superlink/grid/http_grid.py``, ``send_and_receive``):
#: half of each on average (``benchmarks/links.py`` compares it with runs over shaped links).
FLOWER_POLL_SECONDS = 3.0

#: Largest magnitude a client-reported number keeps (larger ones are clamped to it): sums and
#: weighted means over a million clients with weights up to 1e9 then stay far below float64's
#: 1.8e308, so no client value can make the server raise (``OverflowError`` in ``fsum``)
#: or publish an infinite mean. No honest metric comes near it.
METRIC_BOUND = 1e100


def bounded(v: float) -> float:
    """``v`` clamped to [-METRIC_BOUND, METRIC_BOUND] (finite input)."""
    return max(-METRIC_BOUND, min(METRIC_BOUND, float(v)))


def reported_number(metrics: dict, key: str, default: float = 0.0) -> float:
    """A client-reported metric as a finite float within ±`METRIC_BOUND` (untrusted:
    non-numbers and non-finite values become ``default``, larger magnitudes are clamped)."""
    v = metrics.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        return default
    return bounded(v)


def bounded_metrics(metrics: dict) -> dict:
    """The finite scalar metrics of an untrusted reply, each clamped to ±`METRIC_BOUND`
    (ints stay ints where they fit), for the inner strategy's weighted means and metrics.json."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            continue
        out[k] = v if isinstance(v, int) and abs(v) <= METRIC_BOUND else bounded(v)
    return out


def reported_epsilon(v) -> float | None:
    """A client-reported epsilon: a number >= 0 (inf allowed: no privacy), else None (ignored)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        return None
    return float(v)


def client_stats(node: int, metrics: dict, upload_bytes: int, dense_bytes: int, decode_seconds: float,
                 machine: str | None = None) -> dict:
    """One client's figures of the round (a ``client_history`` entry) from its reported metrics.

    Parameters
    ----------
    node : int
        The client's node id.
    metrics : dict
        What the client reported (untrusted: non-numbers count as the default).
    upload_bytes, dense_bytes : int
        Payload bytes received; what the update costs dense (fp32 floats, exact tensors as is).
    decode_seconds : float
        Server time spent decoding the reply.
    machine : str, optional
        The client's ``platform.machine()`` as it reported it.

    A memory report no device can make (`fedcomp.protocol.device.implausible_memory_report`:
    negative, non-finite, above 1 PiB) is dropped whole: its three figures count as 0 (no report) and
    ``device-report-dropped`` holds the reason ("" when kept).
    """
    up = reported_number(metrics, "uplink-mbps", DEFAULT_UPLINK_MBPS)
    dropped = implausible_memory_report(metrics) or ""
    memory = {k: 0.0 if dropped else reported_number(metrics, k) for k in MEMORY_REPORT_KEYS}
    down = reported_number(metrics, "downlink-mbps", DEFAULT_DOWNLINK_MBPS)
    return {
        "node": node,
        "decode-seconds": decode_seconds,
        "train-seconds": reported_number(metrics, "train-seconds"),
        "compress-seconds": reported_number(metrics, "compress-seconds"),
        "clientapp-seconds": max(reported_number(metrics, "clientapp-seconds"), 0.0),
        "uplink-mbps": max(up, MIN_LINK_MBPS) if up > 0 else DEFAULT_UPLINK_MBPS,
        "downlink-mbps": max(down, MIN_LINK_MBPS) if down > 0 else DEFAULT_DOWNLINK_MBPS,
        "residual-bytes": reported_number(metrics, "residual-bytes"),
        "residual-saturated": reported_number(metrics, "residual-saturated"),
        "upload-bytes": float(upload_bytes),
        "dense-bytes": float(dense_bytes),
        "compression-error": reported_number(metrics, "compression-error"),
        "residual-norm": reported_number(metrics, "residual-norm"),
        "download-bytes": reported_number(metrics, "download-bytes"),
        "density": reported_number(metrics, "density"),
        **memory,
        "device-report-dropped": dropped,
        "machine": machine,
        "epsilon": reported_epsilon(metrics.get("epsilon")),
        "epsilon-next": reported_epsilon(metrics.get("epsilon-next")),
    }


def client_seconds(c: dict, uplink_mbps: float | None = None, downlink_mbps: float | None = None) -> float:
    """Simulated seconds of one client's round: compute + upload·8/uplink + download·8/downlink.

    compute is ``train-seconds + compress-seconds``, or the ClientApp process's life
    (``clientapp-seconds``) where that is larger: a SuperNode starts one ``flwr-clientapp`` process
    per message, and its start, imports and data loading cost every round (``benchmarks/links.py``
    compares this model with runs over shaped links). Flower's polling is added per round by `round_metrics`
    (`FLOWER_POLL_SECONDS`). Not modelled: a federated-evaluation phase, the app bundle (FAB)
    each SuperNode downloads once per run, per-request latency (no round-trip time term) and
    protocol bytes on top of the payloads.

    Parameters
    ----------
    c : dict
        A ``client_history`` entry (``train-seconds``, ``compress-seconds``, ``upload-bytes``,
        ``download-bytes``, ``uplink-mbps``, ``downlink-mbps``; ``clientapp-seconds`` optional).
    uplink_mbps, downlink_mbps : float, optional
        Override the client's declared link speeds (megabits per second). Speeds below
        `MIN_LINK_MBPS` count as that speed (the result stays finite).
    """
    up = max(uplink_mbps or c["uplink-mbps"], MIN_LINK_MBPS)
    down = max(downlink_mbps or c["downlink-mbps"], MIN_LINK_MBPS)
    compute = max(c["train-seconds"] + c["compress-seconds"], c.get("clientapp-seconds", 0.0))
    return compute + c["upload-bytes"] * 8 / (up * 1e6) + c["download-bytes"] * 8 / (down * 1e6)


def common_metric_keys(contents: list[RecordDict]) -> None:
    """Trim every reply's MetricRecord to the keys all replies share (Flower's FedAvg requires
    identical keys; an honest client adding a metric of its own must not abort the round)."""
    if not contents:
        return
    common = set.intersection(*(set(c["metrics"].keys()) for c in contents))
    for c in contents:
        m = c["metrics"]
        if set(m.keys()) != common:
            c["metrics"] = MetricRecord({k: v for k, v in m.items() if k in common})


def layers_mean(layer_stats: list[dict], keys: list[str]) -> dict[str, dict[str, float]]:
    """Per-layer means over clients of ``layer-update-norm`` / ``layer-compression-error`` (keys: float tensors)."""
    out: dict[str, dict[str, float]] = {}
    for metric, name in (("layer-update-norm", "update-norm"), ("layer-compression-error", "compression-error")):
        rows = [s[metric] for s in layer_stats if isinstance(s.get(metric), list) and len(s[metric]) == len(keys)]
        if not rows:
            continue
        means = np.mean(np.nan_to_num(np.asarray(rows, dtype=np.float64), nan=0.0, posinf=0.0), axis=0)
        for k, v in zip(keys, means):
            out.setdefault(k, {})[name] = float(v)
    return out


def round_metrics(stats: list[dict], codec_bytes: dict, n_good: int, rejected: int, failed: int) -> dict:
    """The wrapper's own round metrics from the per-client stats (see ``CompressedStrategy``)."""
    up = float(sum(s["upload-bytes"] for s in stats))
    dense = float(sum(s["dense-bytes"] for s in stats))
    out = {
        "upload-bytes": up,
        "dense-bytes": dense,
        "download-bytes": float(sum(s["download-bytes"] for s in stats)),
        "compression-ratio": dense / up if up else 0.0,
        "compression-error": statistics.fmean(s["compression-error"] for s in stats) if stats else 0.0,
        "residual-norm": statistics.fmean(s["residual-norm"] for s in stats) if stats else 0.0,
        "num-replies": n_good,
        "rejected-replies": rejected,
        "failed-clients": failed,
        "density": statistics.fmean(s["density"] for s in stats) if stats else 0.0,
        "residual-saturated": float(sum(s.get("residual-saturated", 0.0) for s in stats)),  # fp16 residual clamps
        "dropped-device-reports": sum(1 for s in stats if s.get("device-report-dropped")),
    }
    if stats:
        # Simulated wall-clock time of the round: the slowest client's compute + transfer time, and in
        # a deployment (clients in per-message flwr-clientapp processes) Flower's polling on top.
        deployed = any(s.get("clientapp-seconds", 0.0) > 0 for s in stats)
        out["round-poll-seconds"] = FLOWER_POLL_SECONDS if deployed else 0.0
        out["round-seconds-simulated"] = max(client_seconds(s) for s in stats) + out["round-poll-seconds"]
        out["train-seconds-max"] = max(s["train-seconds"] for s in stats)
        out["compress-seconds"] = statistics.fmean(s["compress-seconds"] for s in stats)
        out["clientapp-seconds-max"] = max(s.get("clientapp-seconds", 0.0) for s in stats)
        out["decode-seconds"] = float(sum(s["decode-seconds"] for s in stats))
        out["residual-bytes"] = max(s["residual-bytes"] for s in stats)
        out["client-peak-rss-mb"] = max(s.get("client-peak-rss-mb", 0.0) for s in stats)
        # the clients' own link speeds, averaged with fsum (Flower's weighted mean of ten 10.0s
        # gives 10.000000000000002); these replace it in the round's metrics
        out["uplink-mbps"] = statistics.fmean(s["uplink-mbps"] for s in stats)
        out["downlink-mbps"] = statistics.fmean(s["downlink-mbps"] for s in stats)
    for name, nbytes in sorted(codec_bytes.items()):
        out[f"upload-bytes-{name}"] = float(nbytes)
    return out


#: The wrapper's round metrics that reach Flower (the MetricRecord ``aggregate_train`` returns, which
#: Flower logs every round and keeps in its ``Result``): the bytes both ways, the upload's compression
#: ratio and error, how many replies were folded; with DP the epsilon figures. Every other figure of
#: the round stays in ``CompressedStrategy.history`` (and the reference app's ``metrics.json``).
HEADLINE_KEYS = ("upload-bytes", "download-bytes", "compression-ratio", "compression-error", "num-replies",
                 "epsilon", "epsilon-max")


def headline(metrics: dict) -> dict:
    """The `HEADLINE_KEYS` of a round's metrics that it has (DP's only with DP)."""
    return {k: metrics[k] for k in HEADLINE_KEYS if k in metrics}


#: The round metrics of the legacy-API wrapper (``LegacyCompressedStrategy``), in its order.
UPLOAD_KEYS = ("upload-bytes", "dense-bytes", "compression-ratio", "compression-error", "num-replies",
               "rejected-replies", "failed-clients")


def upload_metrics(stats: list[dict], codec_bytes: dict, n_good: int, rejected: int, failed: int) -> dict:
    """`round_metrics`' `UPLOAD_KEYS` and ``upload-bytes-<codec>``, same values: what a
    wrapper reports that knows no download, link speeds or per-layer figures (the legacy API)."""
    full = round_metrics(stats, codec_bytes, n_good, rejected, failed)
    return {**{k: full[k] for k in UPLOAD_KEYS}, **{k: v for k, v in full.items() if k.startswith("upload-bytes-")}}


def per_client(stats: list[dict], key: str) -> dict[str, float]:
    """One reported figure of every client of a round by node id (as a string, metrics.json's keys),
    sorted by node id; e.g. ``per_client(stats, "client-peak-rss-mb")`` is ``client-peak-rss`` in
    metrics.json (MiB). Clients that report 0 (no such figure) are left out."""
    return {str(s["node"]): s[key] for s in sorted(stats, key=lambda s: s["node"]) if s.get(key)}


def machine_counts(stats: list[dict]) -> dict[str, int]:
    """How many of a round's replies came from each machine (``platform.machine()`` as the clients
    report it, e.g. ``{"aarch64": 1, "x86_64": 2}``; replies that name none count as ``"unknown"``)."""
    out: dict[str, int] = {}
    for s in stats:
        name = s.get("machine") or "unknown"
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))
