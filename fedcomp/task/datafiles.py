"""Partition files: a SuperNode's training data as one ``.npz``, prepared where the ``data`` extra is
installed and read on the device with numpy alone.

An edge device (a Raspberry Pi, a Jetson) holds its own data and installs only fedcomp's core
(Flower, numpy, torch). For the default federation, ``python -m fedcomp.task.datafiles`` writes the exact
partitions that `fedcomp.task.data.load_partition` would compute (sklearn digits split by
flwr-datasets' partitioners), one file per node; the node config ``data-file=<path>`` makes the
ClientApp train on that file instead of partitioning the data itself::

    python -m fedcomp.task.datafiles --num-partitions 10 --out partitions/     # on a machine with fedcomp[data]
    flower-supernode ... --node-config "partition-id=3 num-partitions=10 data-file='partitions/partition-3.npz'"

File layout (``numpy.savez``, read with ``allow_pickle=False``): ``images`` float32 (m, C, H, W) in
[0, 1], ``labels`` int64 (m,), and ``meta``, a JSON string of the data settings (dataset, partitioner,
dirichlet-alpha, seed, partition-id, num-partitions) that the ClientApp checks against its run and
node config, so that a file for another split is refused rather than silently trained on.

The same files are the SuperNode's partition cache (`cached_partition`): Flower starts a fresh
ClientApp process for every message, and partitioning the digits again (importing flwr-datasets,
Hugging Face ``datasets`` and scikit-learn) made a train message's process 1.8x slower (5.8 s against
3.2 s wall on an idle core, ``benchmarks/clientapp_process.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import pathlib
import zipfile
from functools import lru_cache
from importlib import metadata

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedcomp.task.cache import cache_dir
from fedcomp.task.data import DATASET_IMAGE_SHAPES, NUM_CLASSES, DataConfig, load_partition
from fedcomp.util.files import write_atomically

#: Node-config key naming a partition file.
DATA_FILE_KEY = "data-file"
#: Distributions whose versions decide what `fedcomp.task.data.load_partition` computes (part of
#: the partition cache's key: an upgrade of any of them computes and caches the partitions anew).
PARTITION_PACKAGES = ("flwr-datasets", "datasets", "scikit-learn", "numpy")
#: Datasets whose partitions `cached_partition` keeps (small, known image shapes).
CACHED_DATASETS = ("digits",)

_log = logging.getLogger(__name__)


def _meta(cfg: DataConfig, partition_id: int, num_partitions: int) -> dict:
    return {"dataset": cfg.dataset, "partitioner": cfg.partitioner, "dirichlet-alpha": float(cfg.dirichlet_alpha),
            "seed": int(cfg.seed), "partition-id": int(partition_id), "num-partitions": int(num_partitions)}


def save_partitions(cfg: DataConfig, num_partitions: int, out_dir: str | os.PathLike) -> list[pathlib.Path]:
    """Write ``partition-<i>.npz`` for ``i`` in ``range(num_partitions)`` (needs the ``data`` extra).

    Parameters
    ----------
    cfg : DataConfig
        The run's data settings (``dataset``, ``partitioner``, ``dirichlet-alpha``, ``seed``).
    num_partitions : int
        Number of SuperNodes (>= 1).
    out_dir : path
        Created if missing; existing files of the same names are replaced atomically.

    Returns
    -------
    list of pathlib.Path
        The files written, in partition order.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for pid in range(num_partitions):
        path = out / f"partition-{pid}.npz"
        _write(path, cfg, pid, num_partitions, *load_partition(cfg, pid, num_partitions).tensors)
        paths.append(path)
    return paths


def load_partition_file(path: str | os.PathLike, cfg: DataConfig, partition_id: int,
                        num_partitions: int) -> TensorDataset:
    """One node's training data from a file of `save_partitions` (numpy only, no pickle).

    Parameters
    ----------
    path : path
        The ``.npz`` file.
    cfg, partition_id, num_partitions
        What the run and node config say; they must equal the file's ``meta``.

    Returns
    -------
    TensorDataset
        ``(images float32 (m, C, H, W), labels int64 (m,))``, as `fedcomp.task.data.load_partition`.

    Raises
    ------
    ValueError
        Naming the file, before anything trains on it: unreadable file, missing arrays, ``meta`` not a
        JSON object, wrong dtypes or shapes (an image shape other than the dataset's, e.g. (1, 8, 8)
        for digits: `fedcomp.task.data.DATASET_IMAGE_SHAPES`), a label outside
        [0, `fedcomp.task.data.NUM_CLASSES`), a pixel that is NaN or infinite, or data settings
        that differ from the run's.
    """
    want = _meta(cfg, partition_id, num_partitions)
    try:
        with np.load(path, allow_pickle=False) as z:
            images, labels, meta = z["images"], z["labels"], json.loads(str(z["meta"]))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # a torn file: BadZipFile
        raise ValueError(f"data-file {path} is not a fedcomp partition file ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"data-file {path}: 'meta' must be a JSON object of the data settings, got "
                         f"{type(meta).__name__}")
    if images.dtype != np.float32 or images.ndim != 4 or labels.dtype != np.int64 or labels.shape != images.shape[:1]:
        raise ValueError(f"data-file {path}: need images float32 (m, C, H, W) and labels int64 (m,), got "
                         f"{images.dtype} {images.shape} and {labels.dtype} {labels.shape}")
    diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if diff:
        raise ValueError(f"data-file {path} was written for other data settings (file, run): {diff}")
    _check_values(path, images, labels, DATASET_IMAGE_SHAPES.get(cfg.dataset))
    return TensorDataset(torch.from_numpy(images), torch.from_numpy(labels))


def _versions() -> dict:
    out = {}
    for name in PARTITION_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def partition_cache_path(cfg: DataConfig, partition_id: int, num_partitions: int) -> pathlib.Path:
    """Where `cached_partition` keeps one partition: ``<cache>/partitions/<key>.npz``, ``key`` the
    first 20 hex digits of the SHA-256 of the data settings and the `PARTITION_PACKAGES` versions
    (``<cache>``: `fedcomp.task.cache.cache_dir`)."""
    key = json.dumps({**_meta(cfg, partition_id, num_partitions), "versions": _versions()}, sort_keys=True)
    return cache_dir() / "partitions" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.npz"


def cached_partition(cfg: DataConfig, partition_id: int, num_partitions: int) -> TensorDataset:
    """`fedcomp.task.data.load_partition`, kept on disk between ClientApp processes.

    A hit reads the partition file (`load_partition_file`: numpy, no pickle, every check)
    without importing flwr-datasets, ``datasets`` or scikit-learn; a miss, or a file that fails a
    check (torn, edited, written for other settings), computes the partition and replaces the
    file atomically (`fedcomp.util.files.write_atomically`). A cache that cannot be written
    (read-only home, full disk) is skipped: the partition is computed in every process, as without
    the cache. Datasets other than `CACHED_DATASETS` are not cached.

    Returns
    -------
    TensorDataset
        Exactly `fedcomp.task.data.load_partition`'s ``(images float32 (m, C, H, W), labels int64 (m,))``.

    Raises
    ------
    ValueError, ModuleNotFoundError
        What `fedcomp.task.data.load_partition` raises on a miss.
    RuntimeError
        ``$FEDCOMP_DATA_DIR`` names a file (`fedcomp.task.cache.cache_dir`).
    """
    if cfg.dataset not in CACHED_DATASETS:
        return load_partition(cfg, partition_id, num_partitions)
    return _cached(cfg, partition_id, num_partitions)


@lru_cache(maxsize=256)  # within one process (a simulation's worker): read the file once
def _cached(cfg: DataConfig, partition_id: int, num_partitions: int) -> TensorDataset:
    path = partition_cache_path(cfg, partition_id, num_partitions)
    if path.is_file():
        try:
            return load_partition_file(path, cfg, partition_id, num_partitions)
        except ValueError as exc:
            _log.warning("fedcomp: partition cache file refused, computing the partition again: %s", exc)
    data = load_partition(cfg, partition_id, num_partitions)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(path, cfg, partition_id, num_partitions, *data.tensors)
    except OSError as exc:
        _log.debug("fedcomp: partition cache not written (%s)", exc)
    return data


def _write(path: pathlib.Path, cfg: DataConfig, partition_id: int, num_partitions: int, images: torch.Tensor,
           labels: torch.Tensor) -> None:
    arrays = {"images": images.numpy().astype(np.float32), "labels": labels.numpy().astype(np.int64),
              "meta": np.array(json.dumps(_meta(cfg, partition_id, num_partitions)))}
    write_atomically(path, lambda f: np.savez(f, **arrays))


def _check_values(path, images: np.ndarray, labels: np.ndarray, image_shape: tuple[int, ...] | None) -> None:
    """Refuse what a model cannot train on: images (m, C, H, W) of another shape than ``image_shape``
    (None: any with C, H, W >= 1), a label outside [0, NUM_CLASSES), a non-finite pixel.

    Raises
    ------
    ValueError
        Naming ``path`` and the first problem found.
    """
    shape = tuple(images.shape[1:])
    if (image_shape is not None and shape != image_shape) or min(shape) < 1:
        raise ValueError(f"data-file {path}: images are {shape} each, the dataset's are "
                         f"{image_shape if image_shape is not None else '(C, H, W) with C, H, W >= 1'}")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise ValueError(f"data-file {path}: labels must be in [0, {NUM_CLASSES}), found {int(labels.min())} "
                         f"to {int(labels.max())}")
    bad = np.count_nonzero(~np.isfinite(images))
    if bad:
        raise ValueError(f"data-file {path}: {bad} pixel(s) are NaN or infinite")


def main(argv: list[str] | None = None) -> None:
    """``python -m fedcomp.task.datafiles --num-partitions N --out DIR [--dataset ... --seed ...]``."""
    d = DataConfig()
    p = argparse.ArgumentParser(prog="python -m fedcomp.task.datafiles", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-partitions", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dataset", default=d.dataset)
    p.add_argument("--partitioner", default=d.partitioner)
    p.add_argument("--dirichlet-alpha", type=float, default=d.dirichlet_alpha)
    p.add_argument("--seed", type=int, default=d.seed)
    a = p.parse_args(argv)
    if a.num_partitions < 1:
        p.error("--num-partitions must be >= 1")
    paths = save_partitions(DataConfig(a.dataset, a.partitioner, a.dirichlet_alpha, a.seed), a.num_partitions, a.out)
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
