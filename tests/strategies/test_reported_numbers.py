"""Numbers a run reports: sign's density is 1.0 (every entry sent), not 0.0; link speeds
are the clients' values without float noise (Flower's weighted mean of ten 10.0s: 10.000000000000002)."""

import numpy as np
import pytest

from fedcomp.client.update import compress_update
from fedcomp.config import CodecConfig
from fedcomp.strategies.round_metrics import round_metrics


@pytest.mark.parametrize("codec,density", [("sign", 1.0), ("int8", 1.0), ("stc", 0.05), ("topk", 0.05)])
def test_the_reported_density_is_the_fraction_of_entries_kept(codec, density):
    rng = np.random.default_rng(0)
    received = {"w": rng.standard_normal((40, 50)).astype(np.float32), "b": np.zeros(50, np.float32)}
    trained = {k: v + 0.1 * rng.standard_normal(v.shape).astype(np.float32) for k, v in received.items()}
    _, _, stats = compress_update(received, trained, CodecConfig(compressor=codec, density=0.05), {}, seed=1)
    assert stats["density"] == density


def test_round_link_speeds_have_no_float_noise():
    weights = [137, 151, 144, 139, 160, 149, 133, 150, 141, 146]
    noisy = sum(10.0 * (w / sum(weights)) for w in weights)  # Flower's aggregate_metricrecords
    assert noisy != 10.0
    stat = {"upload-bytes": 10.0, "dense-bytes": 100.0, "download-bytes": 100.0, "compression-error": 0.5,
            "residual-norm": 1.0, "density": 1.0, "train-seconds": 0.1, "compress-seconds": 0.01,
            "decode-seconds": 0.01, "residual-bytes": 4.0, "uplink-mbps": 1.0, "downlink-mbps": 10.0}
    out = round_metrics([dict(stat) for _ in weights], {}, len(weights), 0, 0)
    assert repr(out["downlink-mbps"]) == "10.0" and repr(out["uplink-mbps"]) == "1.0"
