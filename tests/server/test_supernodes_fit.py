"""More SuperNodes than the data fills: the ServerApp refuses at start-up naming both numbers and what
to do; a client whose partition would be empty says so in one line."""

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from fedcomp.app.startup import RunConfigError
from fedcomp.task.data import DataConfig, load_partition

REFUSAL = ("10000 SuperNodes for 1437 training examples: 10000 partitions of the 1437 training examples of 'digits' "
           "leave some empty (partitioner '{p}' gives each at least {k}; at most {most} partitions fit), so most "
           "sampled clients would fail. Run at most {most} SuperNodes (fedcomp-simulation --supernodes {most}, or "
           "`flwr run` with --federation-config \"num-supernodes={most}\"), or a larger dataset")


def test_capacity_of_the_default_data():
    from fedcomp.task.data import partition_capacity

    assert partition_capacity(DataConfig(partitioner="iid")) == (1437, 1437)
    assert partition_capacity(DataConfig()) == (1437, 718)
    assert partition_capacity(DataConfig(dataset="shakespeare")) is None


@pytest.mark.parametrize("partitioner,k,most", [("iid", 1, 1437), ("dirichlet", 2, 718)])
def test_the_start_up_check_names_both_numbers_and_the_remedy(partitioner, k, most):
    from fedcomp.app.startup import check_supernodes_fit_the_data

    cfg = DataConfig(partitioner=partitioner)
    with pytest.raises(RunConfigError) as err:
        check_supernodes_fit_the_data(10_000, cfg)
    assert str(err.value) == REFUSAL.format(p=partitioner, k=k, most=most)
    check_supernodes_fit_the_data(most, cfg)  # the most that fit pass
    with pytest.raises(RunConfigError):
        check_supernodes_fit_the_data(most + 1, cfg)
    check_supernodes_fit_the_data(10**6, DataConfig(dataset="shakespeare"))  # size unknown up front: not checked


def test_the_server_app_refuses_before_round_0(tmp_path):
    from fedcomp.app.client_app import app as client_app
    from fedcomp.app.server_app import main
    from fedcomp.run.inprocess_grid import InProcessGrid

    results = tmp_path / "results"
    rc = {"partitioner": "iid", "num-server-rounds": 1, "results-dir": str(results)}
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=rc)
    with pytest.raises(RunConfigError) as err:
        main(InProcessGrid(client_app, 10_000, rc), ctx)
    assert str(err.value) == REFUSAL.format(p="iid", k=1, most=1437)
    assert not results.exists()  # nothing started, nothing written


def test_a_client_whose_partition_would_be_empty_says_so_in_one_line():
    with pytest.raises(ValueError) as err:
        load_partition(DataConfig(partitioner="iid"), 5000, 10_000)
    assert str(err.value) == ("partition-id 5000 of 10000 would be empty: 10000 partitions of the 1437 training "
                              "examples of 'digits' leave some empty (partitioner 'iid' gives each at least 1; at "
                              "most 1437 partitions fit)")


def test_a_client_with_an_empty_partition_file_refuses_to_train_in_one_line(tmp_path):
    import json

    from fedcomp.app.client_app import train_handler
    from tests.messages import train_msg

    path = tmp_path / "p.npz"
    meta = {"dataset": "digits", "partitioner": "dirichlet", "dirichlet-alpha": 0.5, "seed": 42,
            "partition-id": 3, "num-partitions": 4}
    np.savez(path, images=np.zeros((0, 1, 8, 8), np.float32), labels=np.zeros(0, np.int64),
             meta=np.array(json.dumps(meta)))
    ctx = Context(run_id=1, node_id=5, node_config={"partition-id": 3, "num-partitions": 4, "data-file": str(path)},
                  state=RecordDict(), run_config={})
    with pytest.raises(ValueError) as err:
        train_handler(train_msg({}, {"compressor": "none"}, dst=5), ctx)
    assert str(err.value) == ("partition-id 3 of 4 holds no training example: nothing to train on (more "
                              "SuperNodes than the data fills?)")
