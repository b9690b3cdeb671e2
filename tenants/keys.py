"""API key format and hashing. Keys are random 256-bit secrets, so a plain SHA-256
is the right hash (no KDF needed); only the hash and a visible prefix are stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string

KEY_PREFIX = "tg-"
_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 8  # the visible, unique part after "tg-"


def generate_key() -> tuple[str, str]:
    """A new secret and its visible prefix."""
    prefix = KEY_PREFIX + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))
    return f"{prefix}_{secrets.token_urlsafe(32)}", prefix


def key_prefix(key: str) -> str | None:
    """The stored visible prefix of a well-formed key, or None for anything else."""
    if not key.startswith(KEY_PREFIX):
        return None
    head, sep, secret = key.partition("_")
    if not sep or len(head) != len(KEY_PREFIX) + _ID_LENGTH or len(secret) < 32:
        return None
    return head


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def matches(key: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_key(key), stored_hash)
