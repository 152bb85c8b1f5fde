"""Read-only views of a Flower Array's bytes (:func:`fedcomp.statedict.numpy_view`): the client reads the
received and trained weights and its kept residual without a model-sized copy each."""

import numpy as np
import pytest


def test_numpy_views_equal_flowers_copies_without_copying():
    from flwr.app import Array, ArrayRecord

    from fedcomp.statedict import BF16, numpy_dict, numpy_view, numpy_views, to_record

    rng = np.random.default_rng(3)
    arrays = {"f32": rng.standard_normal((3, 4)).astype(np.float32), "f16": rng.standard_normal(5).astype(np.float16),
              "f64": np.asfortranarray(rng.standard_normal((2, 3))), "zero_d": np.array(7, np.int64),
              "flag": np.array([True, False]), "empty": np.zeros((0, 3), np.float32)}
    rec = ArrayRecord({k: Array(v) for k, v in arrays.items()})
    views, dtypes = numpy_views(rec)
    _, copy_dtypes = numpy_dict(rec)
    assert dtypes == copy_dtypes
    for k, v in arrays.items():
        assert views[k].dtype == v.dtype and views[k].shape == v.shape and np.array_equal(views[k], v)
        assert not views[k].flags.writeable  # a view of the message's bytes, never written
        if v.size:
            assert np.shares_memory(views[k], np.frombuffer(rec[k].data, np.uint8))
    # bf16 patterns and a truncated buffer take the copying path (and its error)
    import torch

    bf = to_record({"w": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)})
    assert numpy_views(bf)[1] == {"w": BF16} and np.array_equal(numpy_views(bf)[0]["w"], [1.5, -2.0])
    short = Array(dtype="float32", shape=(4,), stype="numpy.ndarray", data=Array(np.zeros(4, np.float32)).data[:-4])
    with pytest.raises(ValueError):
        numpy_view(short)
