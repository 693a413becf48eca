"""Key agreement and derivations: X25519 pair secrets, HKDF-SHA256 seeds, AES-GCM share encryption."""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

PUBLIC_KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16


def hkdf(key: bytes, info: bytes) -> bytes:
    """32 bytes derived from ``key`` for the purpose named by ``info``."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key)


class KeyPair:
    """One pusher's X25519 key pair for one shard (fresh on every (re)join of the roster)."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def pair_secret(self, me: str, peer: str, peer_public: bytes, shard: int) -> bytes:
        """s_pq: HKDF over the X25519 shared secret, bound to the shard and the pair's ids (sorted)."""
        shared = self._private.exchange(X25519PublicKey.from_public_bytes(peer_public))
        low, high = sorted((me, peer))
        return hkdf(shared, f"hfleet-secagg|{shard}|{low}|{high}".encode())


def pair_seed(pair_secret: bytes, shard: int, rnd: int) -> bytes:
    """The pair's mask seed for round ``rnd`` at ``shard`` (revealing it reveals only that mask)."""
    return hkdf(pair_secret, f"hfleet-secagg-mask|{shard}|{rnd}".encode())


def _aad(shard: int, rnd: int, sender: str, recipient: str) -> bytes:
    return f"hfleet-secagg-share|{shard}|{rnd}|{sender}|{recipient}".encode()


def encrypt_share(pair_secret: bytes, shard: int, rnd: int, sender: str, recipient: str, share: bytes) -> bytes:
    """nonce || AES-GCM(share) under HKDF(s_pq, "shares"), bound to (shard, round, sender, recipient)."""
    nonce = os.urandom(NONCE_BYTES)
    key = hkdf(pair_secret, b"shares")
    return nonce + AESGCM(key).encrypt(nonce, share, _aad(shard, rnd, sender, recipient))


def decrypt_share(pair_secret: bytes, shard: int, rnd: int, sender: str, recipient: str, blob: bytes) -> bytes:
    """The share in ``blob``; ValueError when it was not made for this (shard, round, sender, recipient)."""
    try:
        return AESGCM(hkdf(pair_secret, b"shares")).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:],
                                                            _aad(shard, rnd, sender, recipient))
    except InvalidTag:
        raise ValueError(f"share from {sender} for round {rnd} at shard {shard} does not authenticate") from None
