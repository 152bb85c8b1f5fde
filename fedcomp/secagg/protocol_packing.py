"""SecAgg+'s records, re-encoded for the wire: masked vectors at the modulus's bits, public keys as
compressed points, encrypted key shares as raw bytes.

Flower's SecAgg+ masks each value in ``[0, modulus_range)`` and sends it as an int64 ``.npy``;
`pack_masked` packs it at ``log2(modulus_range)`` bits (`check_masked`: the server's checks of a
masked vector, packed or not, before Flower sums it).

Flower's SecAgg+ (flwr 1.42, Bell et al., CCS 2020) sends each node's two ECDH public keys (curve
SECP384R1) as PEM text, 215 bytes where the compressed point is 49, and every encrypted key share as a
Fernet token in URL-safe base64, 4 characters for every 3 bytes. Every node receives the keys of all its
neighbours and sends and receives one token per neighbour, so on a small model (10 nodes that all share
with each other, a CNN of 38k parameters) these records weigh more than the model's download and the
masked vectors together.

Both ends of fedcomp's SecAgg+ re-encode them without loss around Flower's code, which only ever sees its
own forms:

- a node's `fedcomp.secagg.client.packing_secaggplus_mod` packs the keys of its setup reply and the tokens
  of its share-keys reply, and unpacks the keys and tokens of the server's requests before Flower's mod
  reads them;
- `fedcomp.secagg.workflow.CompressedSecAggPlusWorkflow` unpacks each reply before Flower's workflow reads
  it, and packs the requests of the nodes whose setup reply came packed (a node that runs Flower's own mod
  gets Flower's forms).

The server announces that it unpacks with `PACK_KEY` in its setup request (Flower's client mod reads only
its own keys); a node packs its replies only then. A packed value is told apart by its first byte (a PEM
key starts with ``-``, a compressed point with 0x02 or 0x03; a base64 token with ``g``, a raw one with
0x80, Fernet's version byte). Packing keeps a value as it is unless unpacking gives back the very same
bytes, so ``unpack(pack(x)) == x`` for every key and token Flower sends (a value of another kind that
starts with 0x80 is not one a packing node sends).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import struct

import numpy as np
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord
from flwr.common import ndarray_to_bytes
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage

from fedcomp.compression import PayloadError
from fedcomp.compression.bits import nbytes_for_bits, pack_uint, unpack_uint

#: The curve of Flower's SecAgg+ key pairs (``flwr.common.secure_aggregation.crypto``).
CURVE = ec.SECP384R1()
#: Bytes of a compressed point on `CURVE`: one sign byte and the x coordinate.
POINT_BYTES = 1 + (CURVE.key_size + 7) // 8
#: Fernet's version byte, the first byte of every raw token.
FERNET_VERSION = 0x80
#: Key of the server's setup request: it unpacks the keys and tokens of the replies.
PACK_KEY = "fedcomp-packed-protocol"
#: First bytes of a packed masked vector (an ``.npy`` starts with b"\x93NUMPY").
PACK_MAGIC = b"FCSQ\x01"
#: Largest element count a packed masked vector may claim (2**34 values).
MAX_PACKED_NUMEL = 1 << 34


def _pem(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def pack_public_key(pem: bytes) -> bytes:
    """A PEM public key on `CURVE` as its compressed point (`POINT_BYTES` bytes); anything else as it is."""
    if not pem.startswith(b"-----BEGIN PUBLIC KEY-----"):
        return pem
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        return pem
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != CURVE.name or _pem(key) != pem:
        return pem
    return key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint)


def unpack_public_key(value: bytes) -> bytes:
    """Inverse of `pack_public_key`: a compressed point back to Flower's PEM; anything else as it is.

    Raises
    ------
    PayloadError
        A value in the packed form that is not a point on `CURVE`.
    """
    if len(value) != POINT_BYTES or value[0] not in (2, 3):
        return value
    try:
        return _pem(ec.EllipticCurvePublicKey.from_encoded_point(CURVE, value))
    except ValueError as err:
        raise PayloadError(f"packed SecAgg+ public key is not a point on {CURVE.name}: {err}") from None


def pack_token(token: bytes) -> bytes:
    """A Fernet token in URL-safe base64 as its raw bytes (3/4 of the length); anything else as it is."""
    if not token.startswith(b"gA"):
        return token
    try:
        raw = base64.urlsafe_b64decode(token)
    except (ValueError, binascii.Error):
        return token
    return raw if raw[:1] == bytes([FERNET_VERSION]) and base64.urlsafe_b64encode(raw) == token else token


#: DER of SEC1's ``ECPrivateKey`` for `CURVE` without its optional public key: the head up to the private
#: scalar, and the curve's name after it (RFC 5915; OID 1.3.132.0.34 is secp384r1).
_SEC1_HEAD = bytes([0x30, 0x3E, 0x02, 0x01, 0x01, 0x04, 0x30])
_SEC1_TAIL = bytes([0xA0, 0x07, 0x06, 0x05, 0x2B, 0x81, 0x04, 0x00, 0x22])


def compact_private_key(pem: bytes) -> bytes:
    """A PEM private key on `CURVE` in its shortest PEM form: SEC1 ``EC PRIVATE KEY`` with the scalar and
    the curve's name only (150 bytes; Flower writes PKCS#8 with the public key, 306). Anything else as it is.

    Flower's SecAgg+ node shares its first private key, as bytes, with its neighbours (Shamir, 16 bytes
    at a time, one encrypted share per neighbour), and the server loads the key it reconstructs from a
    dropped node's shares with ``load_pem_private_key``, which reads either form: the shorter key makes
    each encrypted share 160 bytes shorter on the wire, both ways, and works with Flower's own workflow.
    The result loads to the same private scalar, or ``pem`` is returned unchanged.
    """
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return pem
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.curve.name != CURVE.name:
        return pem
    scalar = key.private_numbers().private_value.to_bytes((CURVE.key_size + 7) // 8, "big")
    body = base64.b64encode(_SEC1_HEAD + scalar + _SEC1_TAIL)
    lines = b"\n".join(body[i: i + 64] for i in range(0, len(body), 64))
    out = b"-----BEGIN EC PRIVATE KEY-----\n" + lines + b"\n-----END EC PRIVATE KEY-----\n"
    try:
        again = serialization.load_pem_private_key(out, password=None)
    except (ValueError, TypeError):
        return pem
    same = isinstance(again, ec.EllipticCurvePrivateKey) and again.private_numbers() == key.private_numbers()
    return out if same else pem


def unpack_token(value: bytes) -> bytes:
    """Inverse of `pack_token`: raw token bytes back to URL-safe base64; anything else as it is."""
    return base64.urlsafe_b64encode(value) if value[:1] == bytes([FERNET_VERSION]) else value


def is_packed_key(value: object) -> bool:
    """Whether ``value`` is a public key in the packed form (a node that packs its setup reply)."""
    return isinstance(value, bytes) and len(value) == POINT_BYTES and value[0] in (2, 3)


def _map_bytes(value, fn):
    """``fn`` applied to ``value`` if it is bytes, to each bytes entry if it is a list; else ``value``."""
    if isinstance(value, bytes):
        return fn(value)
    if isinstance(value, list):
        return [fn(v) if isinstance(v, bytes) else v for v in value]
    return value


def _convert(stage: str, rec: ConfigRecord, key_fn, token_fn) -> None:
    """Apply ``key_fn`` to the public keys and ``token_fn`` to the tokens of a SecAgg+ record of
    ``stage``, in place: the setup reply's two keys; a share-keys request's neighbour keys (one list of two
    per node id) and its reply's tokens; a collect request's tokens."""
    for name in list(rec.keys()):
        if name == Key.STAGE:
            continue
        if stage == Stage.SETUP and name in (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2):
            rec[name] = _map_bytes(rec[name], key_fn)
        elif stage in (Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS) and name == Key.CIPHERTEXT_LIST:
            rec[name] = _map_bytes(rec[name], token_fn)
        elif stage == Stage.SHARE_KEYS and name.isdigit():  # a neighbour's node id: its [pk1, pk2]
            rec[name] = _map_bytes(rec[name], key_fn)


def pack_record(stage: str, rec: ConfigRecord) -> None:
    """Pack the keys and tokens of a SecAgg+ record (`_convert`), in place."""
    _convert(stage, rec, pack_public_key, pack_token)


def unpack_record(stage: str, rec: ConfigRecord) -> None:
    """Unpack the keys and tokens of a SecAgg+ record back to Flower's forms, in place.

    Raises
    ------
    PayloadError
        A packed public key that is not a point on `CURVE`.
    """
    _convert(stage, rec, unpack_public_key, unpack_token)


# -- the masked vectors ------------------------------------------------------------------------


def pack_masked(npy: np.ndarray, bits: int) -> bytes:
    """A masked int64 array (entries in ``[0, 2**bits)``) packed at ``bits`` bits per entry.

    Layout: ``PACK_MAGIC``, bits (u8), ndim (u8), shape (ndim x u64 little-endian), then
    `fedcomp.compression.bits.pack_uint` of the flattened values.

    Raises
    ------
    ValueError
        An entry outside ``[0, 2**bits)``.
    """
    flat = npy.reshape(-1)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >> bits):
        raise ValueError(f"masked values outside [0, 2**{bits})")
    head = PACK_MAGIC + struct.pack("<BB", bits, npy.ndim) + struct.pack(f"<{npy.ndim}Q", *npy.shape)
    return head + pack_uint(flat, bits)  # cast chunk by chunk: no 8-byte copy of the vector


def unpack_masked(buf: bytes, bits: int, max_numel: int = MAX_PACKED_NUMEL) -> np.ndarray:
    """Inverse of `pack_masked`: int64 array of the shape in the header.

    Raises
    ------
    PayloadError
        Wrong magic or bit width (the server expects ``bits``), a shape over ``max_numel``
        entries, or a body of the wrong length.
    """
    if not buf.startswith(PACK_MAGIC) or len(buf) < len(PACK_MAGIC) + 2:
        raise PayloadError("packed masked vector: bad magic")
    got_bits, ndim = struct.unpack_from("<BB", buf, len(PACK_MAGIC))
    if got_bits != bits:
        raise PayloadError(f"packed masked vector: {got_bits} bits per value, this round's modulus needs {bits}")
    off = len(PACK_MAGIC) + 2
    if ndim > 8 or len(buf) < off + 8 * ndim:
        raise PayloadError("packed masked vector: truncated shape")
    shape = struct.unpack_from(f"<{ndim}Q", buf, off)
    numel = math.prod(shape)
    if numel > max_numel:
        raise PayloadError(f"packed masked vector claims {numel} values (limit {max_numel})")
    body = memoryview(buf)[off + 8 * ndim :]
    if len(body) != nbytes_for_bits(numel * bits):
        raise PayloadError(f"packed masked vector: {len(body)} body bytes for {numel} values of {bits} bits")
    return unpack_uint(body, numel, bits, "packed masked vector").astype(np.int64).reshape(shape)


def check_masked(value, bits: int, k: int | None) -> list[bytes]:
    """A reply's masked vector as the int64 ``.npy`` blobs Flower sums, after checking it.

    Expected: a list of 2 blobs (packed by `pack_masked` or raw ``.npy``, parsed without pickle), int64
    arrays of shapes ``(1,)`` (the weight) and ``(k,)`` (the round's k values; shape unchecked when ``k``
    is None), every value in ``[0, 2**bits)``.

    Raises
    ------
    PayloadError
        Anything else (wrong count, type, dtype, shape or range; not ``.npy``; pickled data).
    """
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(b, bytes) for b in value):
        raise PayloadError("masked vector: expected 2 byte blobs (weight, k values)")
    out = []
    for i, blob in enumerate(value):
        if blob.startswith(PACK_MAGIC):
            arr = unpack_masked(blob, bits)
        else:
            try:
                arr = np.load(io.BytesIO(blob), allow_pickle=False)
            except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed reply
                raise PayloadError(f"masked vector blob {i}: not packed, not a plain .npy ({exc})") from None
            if not isinstance(arr, np.ndarray):
                raise PayloadError(f"masked vector blob {i}: not a single array")
        if arr.dtype != np.int64:
            raise PayloadError(f"masked vector blob {i}: dtype {arr.dtype}, expected int64")
        want = (1,) if i == 0 else ((k,) if k is not None else None)
        if (want is not None and arr.shape != want) or arr.ndim != 1:
            raise PayloadError(f"masked vector blob {i}: shape {arr.shape}, expected {want or '(k,)'}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= (1 << bits)):
            raise PayloadError(f"masked vector blob {i}: values outside [0, 2**{bits})")
        out.append(ndarray_to_bytes(np.ascontiguousarray(arr)))
    return out


__all__ = [
    "MAX_PACKED_NUMEL",
    "PACK_KEY",
    "PACK_MAGIC",
    "POINT_BYTES",
    "check_masked",
    "is_packed_key",
    "pack_masked",
    "pack_public_key",
    "pack_record",
    "pack_token",
    "unpack_masked",
    "unpack_public_key",
    "unpack_record",
    "unpack_token",
]
