"""API key material: `lpx_` + 256 random bits, stored only as a SHA-256 hash.

A fast hash is enough here: the key has far more entropy than any password,
so brute force over the hash is hopeless, and lookup stays one indexed query.
"""

from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "lpx_"
_RANDOM_BYTES = 32
DISPLAY_PREFIX_LENGTH = 12  # "lpx_" + 8 characters, enough to tell keys apart in a listing


def generate_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    return key[:DISPLAY_PREFIX_LENGTH]


def looks_like_api_key(value: str) -> bool:
    return value.startswith(KEY_PREFIX) and len(value) > len(KEY_PREFIX) + 16
