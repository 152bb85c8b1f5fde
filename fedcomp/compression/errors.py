"""Errors raised by the compression layer."""

from __future__ import annotations


class PayloadError(ValueError):
    """A received payload is malformed, truncated, hostile or inconsistent.

    Raised by [`fedcomp.compression.decompress`][] (and everything it calls) for every
    problem found in bytes that came from elsewhere. The message names the field that was
    wrong, e.g. ``"truncated: stc positions need 812 bytes, 17 left"`` or
    ``"bad magic b'PK\\x03\\x04' (expected b'FCMP')"``. It subclasses `ValueError`,
    so callers that already catch ``ValueError`` keep working.
    """
