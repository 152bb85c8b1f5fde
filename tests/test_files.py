"""The one atomic writer (fedcomp.util.files): what every results, checkpoint and client-state file goes through."""

import os

import pytest

from fedcomp.util.files import write_atomically


def test_write_replaces_the_file_syncs_it_and_leaves_no_temporary(tmp_path, monkeypatch):
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    write_atomically(path, b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    assert len(synced) == 2  # the file, then its folder
    write_atomically(path, lambda f: f.write(b"from a writer"))
    assert path.read_bytes() == b"from a writer"


def test_a_writer_that_fails_leaves_the_old_file(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("{}")

    def crash(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, crash)
    assert path.read_text() == "{}"
