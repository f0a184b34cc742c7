"""Content hashes: xxh3-128, fast enough to hash every byte of every file on every crawl."""

from typing import BinaryIO

import xxhash


def hash_bytes(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def hash_text(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def hash_stream(handle: BinaryIO, block_size: int = 1 << 20) -> tuple[str, int]:
    """Hash an open file in blocks so a large file never sits in memory; returns (hash, bytes read)."""
    digest = xxhash.xxh3_128()
    size = 0
    while block := handle.read(block_size):
        digest.update(block)
        size += len(block)
    return digest.hexdigest(), size


def hash_file(path: str) -> tuple[str, int]:
    with open(path, "rb") as handle:
        return hash_stream(handle)
