"""Authentication of the values a :class:`~.store.DualTierStore` writes to its capacity tier.

With a MAC key every value is stored as ``value + tag``: a keyed BLAKE3 tag of :data:`TAG_SIZE`
bytes over the tier key and the value, so a value written without the key, tampered with or moved
to another key does not verify. Pure functions of their arguments: thread-safe.
"""

from __future__ import annotations

import blake3

from .fullchunk import Buffer

# Tier-key suffixes (full, compressed) of authenticated values: stores with a MAC key use their own
# names, so a store without the key never reads (nor deletes) authenticated values.
MAC_SUFFIXES = ("/full.mac", "/ckv.mac")
TAG_SIZE = 32
MIN_KEY_SIZE = 16


def derive_key(mac_key: bytes) -> bytes:
    """The BLAKE3 key derived from a user's ``mac_key`` (at least 16 bytes, else ``ValueError``)."""
    if len(mac_key) < MIN_KEY_SIZE:
        raise ValueError(f"mac_key must be at least {MIN_KEY_SIZE} bytes")
    return blake3.blake3(mac_key, derive_key_context="lmcache_vericache store MAC v1").digest()


def tag(key: bytes, tier_key: str, blob: Buffer) -> bytes:
    """The tag of ``blob`` stored at ``tier_key``, under a key from :func:`derive_key`."""
    h = blake3.blake3(key=key)
    h.update(tier_key.encode() + b"\0")
    h.update(blob)
    return h.digest(TAG_SIZE)


def seal(key: bytes, tier_key: str, blob: bytes) -> bytes:
    """``blob`` with its tag appended, to be stored at ``tier_key``."""
    return blob + tag(key, tier_key, blob)


def unseal(key: bytes, tier_key: str, blob: Buffer) -> memoryview | None:
    """The value of a sealed ``blob`` read from ``tier_key`` (a view, tag stripped), or ``None``
    where the tag does not verify."""
    mv = memoryview(blob).cast("B")
    body = mv[: max(0, mv.nbytes - TAG_SIZE)]
    if mv.nbytes < TAG_SIZE or tag(key, tier_key, body) != bytes(mv[mv.nbytes - TAG_SIZE:]):
        return None
    return body
