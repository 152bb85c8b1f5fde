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
