"""Python side of the native paged-attention kernel (``paged_attention.cc``).

Owns loading the operator (through ``build.load_extension``, once per process) and the call
signature. ``available()`` is False when the kernel cannot be used; callers then keep the
Paddle path in ``worker.attention``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import paddle

from worker.kernels import build

logger = logging.getLogger(__name__)

_EXTENSION = build.Extension("fd_paged_attention_ext", [Path(__file__).with_name("paged_attention.cc")])


def load() -> ModuleType | None:
    """The extension module, built or taken from the cache on first call; None if unavailable."""
    return _EXTENSION.load()


def available() -> bool:
    return _EXTENSION.available()


def paged_attention(
    q: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    block_tables: paddle.Tensor,
    query_starts: paddle.Tensor,
    query_lens: paddle.Tensor,
    context_lens: paddle.Tensor,
    scale: float,
) -> paddle.Tensor:
    """Attention of q [T, heads, D] over the paged cache for every sequence of a step; returns [T, heads * D].

    Sequence ``i`` owns q rows ``query_starts[i] .. + query_lens[i]``, its queries sit at the last
    ``query_lens[i]`` of ``context_lens[i]`` positions (causal, bottom-right aligned) and its keys are
    in the blocks ``block_tables[i]`` ([S, max_blocks] int64; entries past the context are not read).
    The step's own K/V must already be in the cache. q is multiplied by ``scale``.
    """
    module = load()
    if module is None:
        raise build.NativeKernelUnavailable("fd_paged_attention is not available (see the log for why)")
    return module.fd_paged_attention(q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens,
                                     float(scale))


def rope_paged_attention(
    qkv: paddle.Tensor,
    cos_table: paddle.Tensor,
    sin_table: paddle.Tensor,
    positions: paddle.Tensor,
    slots: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    block_tables: paddle.Tensor,
    query_starts: paddle.Tensor,
    query_lens: paddle.Tensor,
    context_lens: paddle.Tensor,
    num_heads: int,
    scale: float,
) -> paddle.Tensor:
    """RoPE, the cache write and attention of one layer in one call; returns [T, num_heads * D].

    ``qkv`` [T, (num_heads + 2 * kv_heads) * D] is the fused projection's output (q heads, k heads,
    v heads). Token ``t`` at ``positions[t]`` gets rotate-half RoPE from the tables ([max_positions, D],
    the sin table sign-folded), its k (rotated) and v are written to cache slot ``slots[t]`` (block *
    block_size + offset) of every KV head, then attention runs as ``paged_attention`` on the rotated q.
    The caches are changed in place.
    """
    module = load()
    if module is None:
        raise build.NativeKernelUnavailable("fd_rope_paged_attention is not available (see the log for why)")
    result = module.fd_rope_paged_attention(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache,
                                            block_tables, query_starts, query_lens, context_lens, int(num_heads),
                                            float(scale))
    return result[0] if isinstance(result, (list, tuple)) else result
