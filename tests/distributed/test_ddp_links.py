"""The shaped-link DDP hook benchmark (``benchmarks/ddp_links.py``) runs in its quick mode: its sides train
over the shaped link, and its JSON holds what the docs page reads. Needs root and network namespaces."""

from __future__ import annotations

import json

import pytest

from tests.distributed.shaped import REPO, run_quick


@pytest.mark.slow
def test_shaped_link_benchmark_quick_mode_writes_its_json(tmp_path):
    out = tmp_path / "ddp_links.json"
    text = run_quick("ddp_links.py", out, "--models", "resnet", timeout=180)
    assert str(tmp_path) not in text and str(REPO) not in text  # no machine paths
    data = json.loads(text)
    runs = {r["side"]: r for r in data["runs"]}
    assert list(runs) == ["ddp (fp32 allreduce)", "torch PowerSGD r1", "fedcomp stc 0.01"]
    assert all("error" not in r and r["replicas_identical"] and r["model"] == "resnet" and r["mbps"] == 100
               for r in runs.values()), runs
    ddp, stc = runs["ddp (fp32 allreduce)"], runs["fedcomp stc 0.01"]
    assert ddp["bytes_per_step"] == 4 * ddp["numel"] and stc["bytes_per_step"] < ddp["bytes_per_step"]
    for r in runs.values():
        # the collectives crossed the shaped link: each rank's interface sent at least half of what it handed
        # to them (an allreduce of 2 ranks sends each its half of the sum twice; an all-gather its payload)
        assert r["wire_bytes_per_step"] >= r["bytes_per_step"] / 2
        assert r["compute_ms"] > 0 and r["step_ms"] > 0 and r["steps_run"] >= data["settings"]["resnet"]["steps"]
    assert ddp["time_to_ddp_final_s"] is not None  # DDP reaches its own final accuracy
    assert stc["encode_decode_share"] is not None and ddp["encode_decode_share"] is None
    assert {t["kind"] for t in data["targets"]} >= {"time", "share"}
    assert data["command"] == "sudo python benchmarks/ddp_links.py --quick --models resnet"


def test_the_time_target_over_seeds_is_the_median_speed_up():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import ddp_links

    def time_target(seed, speedup, common):
        return {"seed": seed, "mbps": 100.0, "model": "resnet", "kind": "time", "side": f"side {seed}",
                "speedup": speedup, "speedup_at_common_compute": common, "ceiling_at_powersgd_steps": 1.25 + seed}

    one = ddp_links.over_seeds([time_target(0, 0.7, 0.6)])
    assert one == []  # one seed: nothing to take the median of
    rows = ddp_links.over_seeds([time_target(0, 0.7, 0.6), time_target(1, 1.9, 1.7), time_target(2, 1.5, 1.2),
                                 {"seed": 0, "mbps": 100.0, "model": "resnet", "kind": "share"}])
    assert rows == [{"mbps": 100.0, "model": "resnet", "kind": "time over seeds", "seeds": [0, 1, 2],
                     "speedup": [0.7, 1.9, 1.5], "median_speedup": 1.5,
                     "speedup_at_common_compute": [0.6, 1.7, 1.2], "median_speedup_at_common_compute": 1.2,
                     "ceiling_at_powersgd_steps": [1.25, 2.25, 3.25], "median_ceiling_at_powersgd_steps": 2.25,
                     "sides": ["side 0", "side 1", "side 2"],
                     "met": "not met: met as measured, not at a common compute"}]
    agreed = ddp_links.over_seeds([time_target(0, 1.6, 1.5), time_target(1, 1.9, 1.7), time_target(2, 0.9, 0.8)])
    assert agreed[0]["median_speedup"] == 1.6 and agreed[0]["met"] == "met"
    unreached = ddp_links.over_seeds([time_target(0, None, None), time_target(1, 2.0, 2.0)])
    assert unreached[0]["median_speedup"] is None and unreached[0]["met"] == "not measurable"
