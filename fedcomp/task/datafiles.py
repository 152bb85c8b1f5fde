"""Partition files: a SuperNode's training data as one ``.npz``, prepared where the ``data`` extra is
installed and read on the device with numpy alone.

An edge device (a Raspberry Pi, a Jetson) holds its own data and installs only fedcomp's core
(Flower, numpy, torch). For the default federation, ``python -m fedcomp.task.datafiles`` writes the exact
partitions that :func:`fedcomp.task.data.load_partition` would compute (sklearn digits split by
flwr-datasets' partitioners), one file per node; the node config ``data-file=<path>`` makes the
ClientApp train on that file instead of partitioning the data itself::

    python -m fedcomp.task.datafiles --num-partitions 10 --out partitions/     # on a machine with fedcomp[data]
    flower-supernode ... --node-config "partition-id=3 num-partitions=10 data-file='partitions/partition-3.npz'"

File layout (``numpy.savez``, read with ``allow_pickle=False``): ``images`` float32 (m, C, H, W) in
[0, 1], ``labels`` int64 (m,), and ``meta``, a JSON string of the data settings (dataset, partitioner,
dirichlet-alpha, seed, partition-id, num-partitions) that the ClientApp checks against its run and
node config, so that a file for another split is refused rather than silently trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedcomp.task.data import DATASET_IMAGE_SHAPES, NUM_CLASSES, DataConfig, load_partition
from fedcomp.util.files import write_atomically

#: Node-config key naming a partition file.
DATA_FILE_KEY = "data-file"


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
        images, labels = load_partition(cfg, pid, num_partitions).tensors
        path = out / f"partition-{pid}.npz"
        arrays = {"images": images.numpy().astype(np.float32), "labels": labels.numpy().astype(np.int64),
                  "meta": np.array(json.dumps(_meta(cfg, pid, num_partitions)))}
        write_atomically(path, lambda f, arrays=arrays: np.savez(f, **arrays))
        paths.append(path)
    return paths


def load_partition_file(path: str | os.PathLike, cfg: DataConfig, partition_id: int,
                        num_partitions: int) -> TensorDataset:
    """One node's training data from a file of :func:`save_partitions` (numpy only, no pickle).

    Parameters
    ----------
    path : path
        The ``.npz`` file.
    cfg, partition_id, num_partitions
        What the run and node config say; they must equal the file's ``meta``.

    Returns
    -------
    TensorDataset
        ``(images float32 (m, C, H, W), labels int64 (m,))``, as :func:`fedcomp.task.data.load_partition`.

    Raises
    ------
    ValueError
        Naming the file, before anything trains on it: unreadable file, missing arrays, ``meta`` not a
        JSON object, wrong dtypes or shapes (an image shape other than the dataset's, e.g. (1, 8, 8)
        for digits: :data:`fedcomp.task.data.DATASET_IMAGE_SHAPES`), a label outside
        [0, :data:`fedcomp.task.data.NUM_CLASSES`), a pixel that is NaN or infinite, or data settings
        that differ from the run's.
    """
    want = _meta(cfg, partition_id, num_partitions)
    try:
        with np.load(path, allow_pickle=False) as z:
            images, labels, meta = z["images"], z["labels"], json.loads(str(z["meta"]))
    except (OSError, KeyError, ValueError) as exc:
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
