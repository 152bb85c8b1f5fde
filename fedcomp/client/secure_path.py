"""Whether the update being trained is encoded by the secure-aggregation mod of this very node.

``compression_mod`` steps aside on a train message that carries fedcomp's SecAgg+ shared seed,
because ``fedcomp.secagg.shared_randomk_mod`` encodes that update. The seed is a train-config key
the server writes, so it alone must not switch a node's compression (and its privacy floor) off: a
plain train message carrying it would get raw, uncompressed, un-noised weights back. The secure mod
marks the call it makes to the train handler (`secure_encoding`, a context variable only code
in this process can set), and ``compression_mod`` steps aside only inside that call
(`encoded_by_secure_mod`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_SECURE_ENCODING: ContextVar[bool] = ContextVar("fedcomp_secure_encoding", default=False)


@contextmanager
def secure_encoding() -> Iterator[None]:
    """Mark the train-handler call of the secure-aggregation mod (which encodes its result itself)."""
    token = _SECURE_ENCODING.set(True)
    try:
        yield
    finally:
        _SECURE_ENCODING.reset(token)


def encoded_by_secure_mod() -> bool:
    """Whether this call runs inside `secure_encoding` (the node's own secure mod)."""
    return _SECURE_ENCODING.get()
