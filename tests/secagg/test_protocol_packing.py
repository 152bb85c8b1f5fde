"""SecAgg+'s keys and encrypted shares packed for the wire: lossless both ways, other values untouched,
a malformed packed key refused, a node running Flower's own mod served in Flower's forms."""

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord
from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import Key, Stage
from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

from fedcomp.compression import PayloadError
from fedcomp.secagg.protocol_packing import (
    POINT_BYTES,
    compact_private_key,
    pack_public_key,
    pack_record,
    pack_token,
    unpack_public_key,
    unpack_record,
    unpack_token,
)

from .helpers import run_round


def _keys(n):
    return [public_key_to_bytes(generate_key_pairs()[1]) for _ in range(n)]


def test_public_keys_pack_to_their_compressed_point_and_back_byte_for_byte():
    for pem in _keys(50):
        packed = pack_public_key(pem)
        assert len(packed) == POINT_BYTES == 49 and len(pem) == 215
        assert unpack_public_key(packed) == pem


def test_tokens_pack_to_raw_bytes_and_back_byte_for_byte():
    sk1, _ = generate_key_pairs()
    _, pk2 = generate_key_pairs()
    key = generate_shared_key(sk1, pk2)
    for n in (0, 1, 15, 16, 333):
        token = encrypt(key, bytes(range(256))[:n] * 2)
        raw = pack_token(token)
        assert raw[0] == 0x80 and len(raw) <= len(token) * 3 // 4
        assert unpack_token(raw) == token


def test_other_values_pass_unchanged():
    other_curve = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    for v in (b"", b"hello", b"gA!!not base64", b"-----BEGIN PUBLIC KEY-----\nbroken", other_curve,
              b"gAAAAA" + b"=" * 3):
        assert pack_public_key(v) in (v,) and pack_token(v) == v
    assert unpack_token(b"plain") == b"plain" and unpack_public_key(b"\x02" * 10) == b"\x02" * 10


def test_a_packed_key_that_is_not_a_point_is_refused():
    with pytest.raises(PayloadError, match="not a point on secp384r1"):
        unpack_public_key(b"\x02" + b"\xff" * (POINT_BYTES - 1))


def test_records_of_each_stage_round_trip():
    k1, k2, k3 = _keys(3)
    setup = ConfigRecord({Key.STAGE: Stage.SETUP, Key.PUBLIC_KEY_1: k1, Key.PUBLIC_KEY_2: k2})
    share = ConfigRecord({Key.STAGE: Stage.SHARE_KEYS, "1001": [k1, k2], "1002": [k3, k1]})
    for stage, rec in ((Stage.SETUP, setup), (Stage.SHARE_KEYS, share)):
        before = dict(rec)
        pack_record(stage, rec)
        assert all(len(b) == POINT_BYTES for v in rec.values() if not isinstance(v, str)
                   for b in (v if isinstance(v, list) else [v]))
        unpack_record(stage, rec)
        assert dict(rec) == before


def test_packing_saves_the_protocol_bytes_and_leaves_the_sum_unchanged():
    """The same round with and without packing: the protocol's bytes shrink, the unmasked sum is the same
    (within SecAgg+'s quantization); an unpacking server's round works with nodes that pack."""
    packed, _, wf_packed, _ = run_round(5, 0.25)
    plain, _, wf_plain, _ = run_round(5, 0.25, pack_protocol=False)
    p, q = wf_packed.round_bytes["secagg-protocol-bytes"], wf_plain.round_bytes["secagg-protocol-bytes"]
    assert p < 0.8 * q
    assert np.abs(packed["w"] - plain["w"]).max() < 1e-3


def test_nodes_running_flowers_own_mod_get_flowers_forms():
    """A node whose setup reply is not packed (Flower's secaggplus_mod) is sent Flower's forms."""
    from flwr.client.mod import secaggplus_mod

    from fedcomp.secagg import shared_randomk_mod

    new, strategy, workflow, _ = run_round(3, 0.25, pack=False, mods=(secaggplus_mod, shared_randomk_mod))
    assert strategy.history[1]["num-replies"] == 3 and not workflow._packed_nodes


def test_a_node_whose_packed_key_is_not_a_point_is_dropped_from_the_round():
    """A setup reply with a malformed packed key: that node leaves the round (an error reply), the others'
    sum is applied."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    from .helpers import RecordingGrid

    class BadKey(RecordingGrid):
        def send_and_receive(self, messages, *, timeout=None):
            out = list(super().send_and_receive(messages, timeout=timeout))
            for r in out:
                rec = r.content.config_records.get(RECORD_KEY_CONFIGS, {}) if not r.has_error() else {}
                if Key.PUBLIC_KEY_1 in rec and self.contexts[r.metadata.src_node_id].node_config["partition-id"] == 2:
                    rec[Key.PUBLIC_KEY_1] = b"\x02" + b"\xff" * (POINT_BYTES - 1)
            return out

    new, strategy, workflow, _ = run_round(4, 0.25, grid_cls=BadKey)
    assert strategy.history[1]["num-replies"] == 3 and np.isfinite(new["w"]).all()


def test_the_shared_private_key_is_kept_in_its_shortest_pem_and_is_the_same_key():
    """150 bytes for Flower's 306 (PKCS#8 with the public key); Flower's Shamir shares of it combine, and
    Flower's loader reads it, to the same key and the same pairwise secret."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, private_key_to_bytes

    for _ in range(20):
        sk1, _pk1 = generate_key_pairs()
        _, pk2 = generate_key_pairs()
        pem = private_key_to_bytes(sk1)
        short = compact_private_key(pem)
        assert len(pem) == 306 and len(short) == 150 and short.startswith(b"-----BEGIN EC PRIVATE KEY-----")
        shares = create_shares(short, 3, 5)
        assert all(len(s) == 4 + 160 for s in shares)  # 150 bytes padded to 10 blocks of 16: 20 blocks before
        again = bytes_to_private_key(combine_shares(shares[1:4]))
        assert again.private_numbers() == sk1.private_numbers()
        assert generate_shared_key(again, pk2) == generate_shared_key(sk1, pk2)
    assert compact_private_key(short) == short


def test_other_private_keys_and_bytes_are_left_as_they_are():
    other = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    for v in (b"", b"not a key", b"-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n", other):
        assert compact_private_key(v) == v


def test_nodes_share_the_short_key_and_a_dropped_nodes_key_is_rebuilt_from_it():
    """In a round the nodes hold the short key (each encrypted share about 300 bytes, not 460), and a
    node that drops after sharing it is unmasked from its shares: the survivors' sum is applied."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE

    from .helpers import RecordingGrid

    tokens = []

    class Tokens(RecordingGrid):
        def send_and_receive(self, messages, *, timeout=None):
            from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

            out = list(super().send_and_receive(messages, timeout=timeout))
            for r in out:
                rec = r.content.config_records.get(RECORD_KEY_CONFIGS, {}) if not r.has_error() else {}
                tokens.extend(rec.get(Key.CIPHERTEXT_LIST, []))
            return out

    new, strategy, _, grid = run_round(5, 0.25, drop=[2], grid_cls=Tokens)
    assert tokens and max(len(t) for t in tokens) <= 310
    held = [c.state.config_records[RECORD_KEY_STATE]["sk1"] for c in grid.contexts.values()]
    assert all(len(k) == 150 for k in held)
    assert strategy.history[1]["num-replies"] == 4 and np.isfinite(new["w"]).all()
