"""The SHA-256 every record of the project writes for a file it read or wrote (manifests, corpus records, train.json)."""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK_BYTES = 1 << 20


def sha256_file(path: Path, chunk_bytes: int = CHUNK_BYTES) -> str:
    """Hex sha256 of a file, read in chunks so a multi-GB graph never sits in memory whole."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
