"""Where the KV cache lives and how it is shaped; shared by worker, engine and transfer process (no paddle).

Device pool (owned by the worker): ``[layers, 2 (k, v), num_blocks, kv_heads, block_size, head_dim]`` float32, so
one block is strided across layers. Host pool (owned by the cache transfer process): block-major
``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``, so one host block is one contiguous object, which is
also exactly the bytes one storage object holds.

Within a block the KV heads are outermost: one head's ``block_size`` rows are contiguous, so decode attention
gathers whole blocks per head (``block_size * head_dim`` floats at a time) straight into ``[.., heads, len, D]``
order. Measured on this CPU for 32 sequences of 128 tokens: 9.0 ms per step for the 60 gathers of SmolLM2, against
15.1 ms for the token-major layout it replaced, whose gathers move one 256-byte row at a time.
"""
from __future__ import annotations

from inter_communicator.shm import ipc_name


# Part of every storage key: objects written with another block layout are never read back as this one.
KV_LAYOUT_TAG = "hm"


def device_cache_shape(model_config, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (model_config.num_hidden_layers, 2, num_blocks, model_config.num_key_value_heads, block_size,
            model_config.head_dim)


def host_cache_shape(model_config, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (num_blocks, model_config.num_hidden_layers, 2, model_config.num_key_value_heads, block_size,
            model_config.head_dim)


def block_shape(model_config, block_size: int) -> tuple[int, ...]:
    """One block in host / storage layout."""
    return host_cache_shape(model_config, 1, block_size)[1:]


def device_cache_segment(instance_id: str, dp_rank: int, tp_rank: int) -> str:
    return ipc_name(instance_id, f"kvcache_tp{tp_rank}", dp_rank)


def host_cache_segment(instance_id: str, dp_rank: int, tp_rank: int) -> str:
    return ipc_name(instance_id, f"hostcache_tp{tp_rank}", dp_rank)


def storage_key(model_fingerprint: str, block_hash: str, tp_rank: int) -> str:
    """Storage object key: the model fingerprint keeps another model from ever reading these bytes."""
    return f"{model_fingerprint}{KV_LAYOUT_TAG}_{block_hash}_tp{tp_rank}"
