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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]  # the temporary file is removed too


def test_interleaved_writers_of_one_path_each_write_their_own_temporary(tmp_path):
    """A second writer of the same path starts while the first is mid-write (two processes filling the
    same cache file): with one shared ``<name>.tmp`` the second truncated and renamed the first's file,
    whose own rename then failed with FileNotFoundError. Now both complete and the last rename wins."""
    path = tmp_path / "p.npz"

    def outer(f):
        f.write(b"outer ")
        write_atomically(path, b"inner, complete")  # another writer, start to finish, in between
        assert path.read_bytes() == b"inner, complete"
        f.write(b"complete")

    write_atomically(path, outer)
    assert path.read_bytes() == b"outer complete"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz"]
