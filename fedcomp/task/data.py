"""Default data: scikit-learn's ``load_digits`` (1,797 real 8x8 handwritten digits, shipped
with scikit-learn, no download), with a fixed held-out test split for the server and the
rest partitioned across clients by flwr-datasets partitioners (``IidPartitioner``,
``DirichletPartitioner``). Any Hugging Face dataset with an image and a label column can
be used instead through ``FederatedDataset`` (needs internet). ``"shakespeare"`` is LEAF's
next-character task, one client per speaking role (`fedcomp.task.text_data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedcomp.util.extras import require

#: Images of scikit-learn's digits, and those held out for server-side evaluation (20 %).
DIGITS_SIZE, DIGITS_TEST_SIZE = 1797, 360
PARTITIONERS = ("iid", "dirichlet")
#: Fewest training examples each partitioner gives a partition (Dirichlet: its ``min_partition_size``).
MIN_PARTITION_SIZE = {"iid": 1, "dirichlet": 2}
#: Labels the reference app's image models classify (``fedcomp.task.models.build_model``'s default).
NUM_CLASSES = 10
#: Image shape (C, H, W) of each known image dataset (digits: 8x8 grey).
DATASET_IMAGE_SHAPES = {"digits": (1, 8, 8)}


@dataclass(frozen=True)
class DataConfig:
    """What data to load and how to split it (from the run config).

    Attributes
    ----------
    dataset : str
        "digits" (default, offline), "shakespeare" (LEAF's roles; partitioner and alpha unused)
        or a Hugging Face dataset name such as "ylecun/mnist".
    partitioner : str
        "iid" or "dirichlet".
    dirichlet_alpha : float
        Concentration of the Dirichlet label split (> 0); smaller is more heterogeneous.
    seed : int
        Seed of the split.
    """

    dataset: str = "digits"
    partitioner: str = "dirichlet"
    dirichlet_alpha: float = 0.5
    seed: int = 42


def _make_partitioner(cfg: DataConfig, num_partitions: int):
    partitioner = require("flwr_datasets.partitioner", "partitioning the data")
    DirichletPartitioner, IidPartitioner = partitioner.DirichletPartitioner, partitioner.IidPartitioner

    if cfg.partitioner == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if cfg.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=cfg.dirichlet_alpha,
            min_partition_size=MIN_PARTITION_SIZE["dirichlet"], self_balancing=True, seed=cfg.seed,
        )
    raise ValueError(f"partitioner must be one of {PARTITIONERS}, got {cfg.partitioner!r}")


def _digits_arrays(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    load_digits = require("sklearn.datasets", "the default digits data").load_digits
    train_test_split = require("sklearn.model_selection", "the default digits data").train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return train_test_split(X, y.astype(np.int64), test_size=DIGITS_TEST_SIZE, random_state=seed, stratify=y)


def _to_tensor_dataset(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
    return TensorDataset(torch.from_numpy(np.ascontiguousarray(images)), torch.from_numpy(labels))


@lru_cache(maxsize=256)
def load_partition(cfg: DataConfig, partition_id: int, num_partitions: int) -> TensorDataset:
    """Training data of one client.

    Parameters
    ----------
    cfg : DataConfig
    partition_id : int
        ``0 <= partition_id < num_partitions`` (Flower's node config ``partition-id``).
    num_partitions : int
        Number of clients the training split is divided among.

    Returns
    -------
    TensorDataset
        ``(images float32 (m, 1, H, W) in [0, 1], labels int64 (m,))``.

    Raises
    ------
    ValueError
        Partition id out of range, unknown partitioner or dataset, or more partitions than the data
        fills (`too_many_partitions`: one line naming both numbers).
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    if cfg.dataset == "shakespeare":
        from fedcomp.task.text_data import load_text_partition

        return load_text_partition(partition_id, num_partitions, cfg.seed)
    if cfg.dataset == "digits":
        if too_many := too_many_partitions(cfg, num_partitions):
            raise ValueError(f"partition-id {partition_id} of {num_partitions} would be empty: {too_many}")
        Dataset = require("datasets", "partitioning the digits data").Dataset

        X_train, _, y_train, _ = _digits_arrays(cfg.seed)
        ds = Dataset.from_dict({"idx": np.arange(len(y_train)), "label": y_train})
        part = _make_partitioner(cfg, num_partitions)
        part.dataset = ds
        idx = np.asarray(part.load_partition(partition_id)["idx"], dtype=np.int64)
        return _to_tensor_dataset(X_train[idx], y_train[idx])
    return _hub_partition(cfg, partition_id, num_partitions)


def partition_capacity(cfg: DataConfig) -> tuple[int, int] | None:
    """(training examples, most partitions they fill) of a dataset whose size is known without
    loading it (digits: 1437 examples; 1437 partitions with "iid", 718 with "dirichlet", which gives
    each at least 2), else None."""
    if cfg.dataset != "digits":
        return None
    examples = DIGITS_SIZE - DIGITS_TEST_SIZE
    return examples, examples // MIN_PARTITION_SIZE.get(cfg.partitioner, 1)


def too_many_partitions(cfg: DataConfig, num_partitions: int) -> str:
    """Why ``num_partitions`` partitions of ``cfg``'s training data leave some empty (one sentence
    naming both numbers and the most that fit, `partition_capacity`), or "" when they fit or
    the dataset's size is not known up front."""
    known = partition_capacity(cfg)
    if known is None or num_partitions <= known[1]:
        return ""
    examples, most = known
    return (f"{num_partitions} partitions of the {examples} training examples of '{cfg.dataset}' leave some "
            f"empty (partitioner '{cfg.partitioner}' gives each at least {MIN_PARTITION_SIZE.get(cfg.partitioner, 1)};"
            f" at most {most} partitions fit)")


@lru_cache(maxsize=2)
def load_test_set(cfg: DataConfig) -> TensorDataset:
    """The server's held-out test split (digits: 360 stratified images; shakespeare: a seeded sample
    of the roles' test windows, `fedcomp.task.text_data.load_text_test_set`; hub: its "test" split)."""
    if cfg.dataset == "shakespeare":
        from fedcomp.task.text_data import load_text_test_set

        return load_text_test_set(cfg.seed)
    if cfg.dataset == "digits":
        _, X_test, _, y_test = _digits_arrays(cfg.seed)
        return _to_tensor_dataset(X_test, y_test)
    load_dataset = require("datasets", "a Hugging Face dataset").load_dataset

    return hf_to_tensor_dataset(load_dataset(cfg.dataset, split="test"))


def hf_to_tensor_dataset(ds) -> TensorDataset:
    """Convert a Hugging Face dataset with an image column ("image" or "img") and "label".

    Images (``(H, W)`` or ``(H, W, C)`` each) become float32 ``(m, C, H, W)`` in [0, 1]: divided
    by 255 when any pixel exceeds 1, else kept. Labels become int64 ``(m,)``.
    """
    col = "image" if "image" in ds.column_names else "img"
    imgs = np.stack([np.asarray(im, dtype=np.float32) for im in ds[col]])
    if imgs.ndim == 3:
        imgs = imgs[:, None]
    elif imgs.ndim == 4:
        imgs = imgs.transpose(0, 3, 1, 2)
    scale = 255.0 if imgs.max() > 1.0 else 1.0
    return _to_tensor_dataset((imgs / scale).astype(np.float32), np.asarray(ds["label"], dtype=np.int64))


def _hub_partition(cfg: DataConfig, partition_id: int, num_partitions: int) -> TensorDataset:
    FederatedDataset = require("flwr_datasets", "a Hugging Face dataset").FederatedDataset

    fds = FederatedDataset(dataset=cfg.dataset, partitioners={"train": _make_partitioner(cfg, num_partitions)})
    return hf_to_tensor_dataset(fds.load_partition(partition_id, "train"))
