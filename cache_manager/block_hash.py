"""Chained content hashes of full KV blocks.

A block's hash covers its parent's hash, its token ids and the model
fingerprint, so equal hashes mean equal KV contents for the whole prefix, and
another model's blocks can never match. The hex digest doubles as the storage
key component (``kv_layout.storage_key``).
"""
from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = ""


def hash_block(parent_hash: str, token_ids: list[int], model_fingerprint: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash.encode())
    digest.update(b"|")
    digest.update(model_fingerprint.encode())
    digest.update(b"|")
    digest.update(array("q", token_ids).tobytes())
    return digest.hexdigest()


def hash_full_blocks(token_ids: list[int], block_size: int, model_fingerprint: str, num_blocks: int | None = None,
                     parent_hash: str = ROOT_HASH, start_block: int = 0) -> list[str]:
    """Hashes of the full blocks ``start_block .. start_block + num_blocks`` of ``token_ids``."""
    available = len(token_ids) // block_size
    end = available if num_blocks is None else min(available, start_block + num_blocks)
    hashes = []
    for index in range(start_block, end):
        parent_hash = hash_block(parent_hash, token_ids[index * block_size:(index + 1) * block_size],
                                 model_fingerprint)
        hashes.append(parent_hash)
    return hashes
