"""Default data and partitioning (flwr-datasets partitioners on sklearn digits)."""

import numpy as np
import pytest

from fedcomp.task.data import DIGITS_TEST_SIZE, DataConfig, hf_to_tensor_dataset, load_partition, load_test_set
from fedcomp.task.models import build_model


@pytest.mark.parametrize("partitioner", ["iid", "dirichlet"])
def test_partitions_cover_the_training_split_exactly_once(partitioner):
    cfg = DataConfig(partitioner=partitioner)
    parts = [load_partition(cfg, i, 5) for i in range(5)]
    assert sum(len(p) for p in parts) == 1797 - DIGITS_TEST_SIZE
    from fedcomp.task.data import _digits_arrays

    x_train = _digits_arrays(cfg.seed)[0].reshape(1797 - DIGITS_TEST_SIZE, -1)
    imgs = np.concatenate([p.tensors[0].numpy().reshape(len(p), -1) for p in parts])
    # same multiset of rows as the training split: sort rows lexicographically and compare
    assert np.array_equal(np.unique(imgs, axis=0, return_counts=True)[1].sum(), len(x_train))
    assert np.array_equal(imgs[np.lexsort(imgs.T)], x_train[np.lexsort(x_train.T)])
    assert parts[0].tensors[0].shape[1:] == (1, 8, 8)
    assert float(parts[0].tensors[0].max()) <= 1.0


def test_test_split_is_fixed_and_held_out():
    a, b = load_test_set(DataConfig()), load_test_set(DataConfig())
    assert len(a) == DIGITS_TEST_SIZE
    assert np.array_equal(a.tensors[1].numpy(), b.tensors[1].numpy())
    assert sorted(set(a.tensors[1].tolist())) == list(range(10))


def test_dirichlet_is_more_skewed_than_iid():
    def skew(p):
        counts = np.bincount(p.tensors[1].numpy(), minlength=10)
        return counts.max() / max(len(p), 1)

    iid = np.mean([skew(load_partition(DataConfig(partitioner="iid"), i, 10)) for i in range(10)])
    dirich = np.mean([skew(load_partition(DataConfig(dirichlet_alpha=0.1), i, 10)) for i in range(10)])
    assert dirich > iid + 0.15


def test_bad_partition_id_and_partitioner():
    with pytest.raises(ValueError, match="partition-id 3"):
        load_partition(DataConfig(), 3, 3)
    with pytest.raises(ValueError, match="partitioner"):
        load_partition(DataConfig(partitioner="zipf"), 0, 3)


def test_hub_dataset_conversion_on_local_data():
    from datasets import Dataset

    rng = np.random.default_rng(0)
    ds = Dataset.from_dict({"image": [rng.integers(0, 256, (28, 28)).astype(np.uint8) for _ in range(6)],
                            "label": [0, 1, 2, 3, 4, 5]})
    t = hf_to_tensor_dataset(ds)
    assert t.tensors[0].shape == (6, 1, 28, 28) and float(t.tensors[0].max()) <= 1.0
    model = build_model("mlp", (1, 28, 28))
    assert model(t.tensors[0]).shape == (6, 10)
    with pytest.raises(ValueError, match="mlp"):
        build_model("cnn", (1, 28, 28))


def _partition_file(tmp_path, images, labels, meta=None, name="p.npz"):
    import json

    meta = {"dataset": "digits", "partitioner": "dirichlet", "dirichlet-alpha": 0.5, "seed": 42,
            "partition-id": 0, "num-partitions": 3} if meta is None else meta
    path = tmp_path / name
    np.savez(path, images=images, labels=labels, meta=np.array(json.dumps(meta)))
    return path


@pytest.mark.parametrize("case,message", [
    ("meta-list", "'meta' must be a JSON object of the data settings, got list"),
    ("meta-number", "'meta' must be a JSON object of the data settings, got int"),
    ("shape", "images are (1, 9, 9) each, the dataset's are (1, 8, 8)"),
    ("label-high", "labels must be in [0, 10), found 0 to 10"),
    ("label-negative", "labels must be in [0, 10), found -1 to 3"),
    ("nan", "2 pixel(s) are NaN or infinite"),
])
def test_a_bad_partition_file_is_refused_naming_the_file(tmp_path, case, message):
    from fedcomp.task.datafiles import load_partition_file

    images, labels, meta = np.full((4, 1, 8, 8), 0.5, np.float32), np.array([0, 1, 2, 3], np.int64), None
    if case == "meta-list":
        meta = [1, 2]
    elif case == "meta-number":
        meta = 7
    elif case == "shape":
        images = np.zeros((4, 1, 9, 9), np.float32)
    elif case == "label-high":
        labels[3] = 10
    elif case == "label-negative":
        labels[0] = -1
    elif case == "nan":
        images[1, 0, 2, 3], images[3, 0, 0, 0] = np.nan, np.inf
    path = _partition_file(tmp_path, images, labels, meta)
    with pytest.raises(ValueError) as err:
        load_partition_file(path, DataConfig(), 0, 3)
    assert str(err.value) == f"data-file {path}: {message}"


def test_a_good_partition_file_loads_as_is(tmp_path):
    from fedcomp.task.datafiles import load_partition_file

    images, labels = np.linspace(0, 1, 2 * 64, dtype=np.float32).reshape(2, 1, 8, 8), np.array([9, 0], np.int64)
    x, y = load_partition_file(_partition_file(tmp_path, images, labels), DataConfig(), 0, 3).tensors
    assert np.array_equal(x.numpy(), images) and y.tolist() == [9, 0]
