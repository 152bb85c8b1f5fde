"""The SuperNode's partition cache (fedcomp.task.datafiles.cached_partition): a hit equals the computed
partition and imports none of the partitioning libraries; a torn, edited or foreign file is refused and
replaced; an unwritable cache is skipped; another library version is another key."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fedcomp.task import datafiles
from fedcomp.task.cache import CACHE_ENV
from fedcomp.task.data import DataConfig, load_partition

CFG = DataConfig(seed=7)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    datafiles._cached.cache_clear()
    yield tmp_path
    datafiles._cached.cache_clear()


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a.tensors, b.tensors))


def test_miss_writes_one_file_and_a_hit_reads_it_back(cache):
    got = datafiles.cached_partition(CFG, 1, 4)
    assert _equal(got, load_partition(CFG, 1, 4))
    files = sorted((cache / "partitions").iterdir())
    assert files == [datafiles.partition_cache_path(CFG, 1, 4)]
    datafiles._cached.cache_clear()
    assert _equal(datafiles.cached_partition(CFG, 1, 4), got)
    assert datafiles.partition_cache_path(CFG, 2, 4) != files[0]
    assert datafiles.partition_cache_path(DataConfig(seed=8), 1, 4) != files[0]


HIT = r"""
import json, sys
from fedcomp.task.data import DataConfig
from fedcomp.task.datafiles import cached_partition
images, labels = cached_partition(DataConfig(seed=7), 1, 4).tensors
heavy = sorted(m for m in ("flwr_datasets", "datasets", "sklearn", "pandas", "pyarrow") if m in sys.modules)
print(json.dumps({"heavy": heavy, "sum": float(images.sum()), "labels": labels.tolist()}))
"""


def test_a_hit_in_a_fresh_process_imports_no_partitioning_library(cache):
    want = datafiles.cached_partition(CFG, 1, 4)
    out = subprocess.run([sys.executable, "-c", HIT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, CACHE_ENV: str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == []
    assert got["labels"] == want.tensors[1].tolist()
    assert got["sum"] == pytest.approx(float(want.tensors[0].sum()), rel=1e-6)


@pytest.mark.parametrize("damage", ["torn", "other-partition", "nan"])
def test_a_bad_cache_file_is_refused_and_replaced(cache, damage, caplog):
    want = datafiles.cached_partition(CFG, 1, 4)
    path = datafiles.partition_cache_path(CFG, 1, 4)
    if damage == "torn":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "other-partition":  # a valid file of partition 0 copied over partition 1's
        datafiles._write(path, CFG, 0, 4, *load_partition(CFG, 0, 4).tensors)
    else:
        images, labels = (t.clone() for t in want.tensors)
        images[0, 0, 0, 0] = float("nan")
        datafiles._write(path, CFG, 1, 4, images, labels)
    datafiles._cached.cache_clear()
    with caplog.at_level("WARNING", logger="fedcomp.task.datafiles"):
        got = datafiles.cached_partition(CFG, 1, 4)
    assert _equal(got, want)
    assert "partition cache file refused" in caplog.text
    # the file was replaced by a good one: the next process reads it without complaint
    assert _equal(datafiles.load_partition_file(path, CFG, 1, 4), want)


def test_an_unwritable_cache_is_skipped(cache, monkeypatch):
    def refuse(path, write):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(datafiles, "write_atomically", refuse)
    got = datafiles.cached_partition(CFG, 2, 4)
    assert _equal(got, load_partition(CFG, 2, 4))
    assert not datafiles.partition_cache_path(CFG, 2, 4).exists()


def test_another_library_version_is_another_key(cache, monkeypatch):
    before = datafiles.partition_cache_path(CFG, 0, 4)
    real = datafiles.metadata.version
    monkeypatch.setattr(datafiles.metadata, "version",
                        lambda name: "0.0.1" if name == "flwr-datasets" else real(name))
    assert datafiles.partition_cache_path(CFG, 0, 4) != before


def test_a_data_dir_that_is_a_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "f"))
    datafiles._cached.cache_clear()
    with pytest.raises(RuntimeError, match="FEDCOMP_DATA_DIR = .* is not a directory"):
        datafiles.cached_partition(CFG, 0, 4)
    datafiles._cached.cache_clear()


def test_other_datasets_pass_through_uncached(cache, monkeypatch):
    seen = []
    monkeypatch.setattr(datafiles, "load_partition", lambda *a: seen.append(a) or "computed")
    cfg = DataConfig(dataset="shakespeare")
    assert datafiles.cached_partition(cfg, 0, 2) == "computed" and seen == [(cfg, 0, 2)]
    assert not (cache / "partitions").exists()
