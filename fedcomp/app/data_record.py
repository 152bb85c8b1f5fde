"""The data a run trains on, recorded in its checkpoint and checked on resume.

A client's partition is a function of ``seed``, ``dataset``, ``partitioner`` and ``dirichlet-alpha``
(`fedcomp.task.data.load_partition`). A resume with another value of any of them would go on
training on other partitions than the checkpoint's rounds used, silently: it is refused, naming each
key with both values. A checkpoint written before these settings were recorded holds none: it is
resumed with one WARNING that the data settings could not be compared.
"""

from __future__ import annotations

from logging import WARNING

from flwr.common.logger import log

from fedcomp.app.config import AppConfig

#: Key of the record in the checkpoint manifest's ``extra``.
DATA_KEY = "data-settings"


def data_settings(cfg: AppConfig) -> dict:
    """``{"seed", "dataset", "partitioner", "dirichlet-alpha"}`` of the run config, for the checkpoint."""
    return {"seed": cfg.seed, "dataset": cfg.dataset, "partitioner": cfg.partitioner,
            "dirichlet-alpha": cfg.dirichlet_alpha}


def check_same_data(meta: dict, cfg: AppConfig) -> None:
    """Refuse a resume whose data settings differ from those the checkpoint recorded.

    Raises
    ------
    ValueError
        ``run config 'resume': the data settings differ from the checkpoint's: 'seed' = 7 (checkpoint:
        42), ...``, every differing key with both values.
    """
    saved = meta.get("extra", {}).get(DATA_KEY)
    if saved is None:
        log(WARNING, "fedcomp  the checkpoint records no data settings (written by an older fedcomp): the "
                     "resumed run's seed, dataset, partitioner and dirichlet-alpha could not be compared with it")
        return
    now = data_settings(cfg)
    diff = [f"'{k}' = {now[k]!r} (checkpoint: {saved.get(k)!r})" for k in now if saved.get(k) != now[k]]
    if diff:
        raise ValueError("run config 'resume': the data settings differ from the checkpoint's: " + ", ".join(diff)
                         + ". The clients' partitions follow from them: resume with the checkpoint's values, or "
                         "start a new run (another 'results-dir')")


__all__ = ["DATA_KEY", "check_same_data", "data_settings"]
