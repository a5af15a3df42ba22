"""Paged attention over a block-structured KV cache, for a flattened varlen batch.

This module owns the KV cache *layout* (not its memory: the worker's model runner
allocates that, on CPU in POSIX shared memory), the per-step ``AttentionMetadata``
that maps tokens to cache slots, and ``paged_attention`` itself.

Layout (``cache_manager.kv_layout``): per layer a ``(k_cache, v_cache)`` pair, each
``[num_blocks, num_kv_heads, block_size, head_dim]`` float32. Slot ``s`` is
``block * block_size + offset``; its row for KV head ``h`` in the ``[-1, head_dim]``
view is ``(block * num_kv_heads + h) * block_size + offset``.

A step's tokens are the concatenation of its sequences' new tokens: decode
sequences (one new token) first, then prefill chunks. Two implementations:

- native (``worker/kernels/paged_attention.cc``, used when it builds; FD_NATIVE_KERNELS):
  one call for the whole step reads K/V blocks in place, flash-attention style (tiled,
  online softmax, no score matrix over the context), for decodes and prefill chunks alike.
- Paddle (the fallback, and the reference the native kernel is tested against): decodes
  are batched into one gather + two batched matmuls; prefill chunks run one sequence at a
  time with a bottom-right aligned causal mask, so a chunk may follow a cached prefix.

CPU performance notes (Paddle 3.3.1, measured): 4-D transposes of gathered K/V are
~100x slower than 3-D ones, and broadcasting element-wise ops are ~10x slower than
same-shape ones. So K/V are gathered straight into ``[.., kv_heads, len, head_dim]``
order by index (``paddle.gather``: ~4x faster than ``index_select`` for these row
gathers); decode gathers whole per-head blocks, which the head-major block layout
keeps contiguous. Decode masks are materialised at full score shape once per step
(cached on the metadata and reused by every layer).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from worker.kernels import build as kernel_build
from worker.kernels import paged_attention as native_attention

logger = logging.getLogger(__name__)

# Additive mask value: finite so that a fully masked row can never produce NaN via (-inf) - (-inf).
_MASKED = -1e30

# Prefill attention runs over query tiles of this many rows: each tile's scores stay
# cache-sized and skip the keys after its last query (measured 4x faster than one
# [heads, 1024, 1024] block for a 1024-token prompt, equal at 128 tokens).
_PREFILL_QUERY_TILE = 128
# Upper bound on score elements (heads * tile rows * context) of one tile, for very long contexts.
_PREFILL_SCORE_BUDGET = 16 * 1024 * 1024


def kv_cache_views(array: np.ndarray) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
    """Per-layer ``(k_cache, v_cache)`` paddle tensors sharing ``array``'s memory (no copy).

    ``array`` must be a C-contiguous float32 array shaped like ``device_cache_shape``; writes
    through the returned tensors land in it (and so in the shared-memory segment behind it).
    """
    if array.ndim != 6 or array.shape[1] != 2:
        raise ValueError(
            f"KV cache array must be [layers, 2, blocks, kv_heads, block_size, head_dim], got {array.shape}"
        )
    if array.dtype != np.float32:
        raise ValueError(f"KV cache array must be float32, got {array.dtype}")
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError("KV cache array must be C-contiguous and writeable")
    views = []
    for layer in range(array.shape[0]):
        # from_dlpack wraps the numpy buffer; paddle.to_tensor would copy it.
        k_cache = paddle.utils.dlpack.from_dlpack(array[layer, 0])
        v_cache = paddle.utils.dlpack.from_dlpack(array[layer, 1])
        views.append((k_cache, v_cache))
    # The worker maps its cache once, at start-up: building (or loading) the native kernel here keeps a
    # cold compile (~30 s) out of the first request's step, and FD_NATIVE_KERNELS=1 fails at start.
    use_native_kernel()
    return views


@dataclass
class PrefillChunk:
    """One sequence's prefill tokens within the flattened batch."""

    query_start: int
    query_len: int
    context_len: int
    # Cache slots of positions 0..context_len-1; None when the chunk has no cached prefix
    # (context_len == query_len), in which case the fresh k/v are used without a gather.
    context_slots: np.ndarray | None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""

    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    num_decodes: int
    num_tokens: int
    positions: paddle.Tensor  # [T] int64, position of each new token
    slot_mapping: np.ndarray  # [T] int64, cache slot each new token's k/v is written to
    last_token_indices: paddle.Tensor  # [num_seqs] int64, row of each sequence's last token
    decode_block_tables: np.ndarray | None  # [num_decodes, max_decode_blocks] int64, padded with a valid block
    decode_context_lens: np.ndarray | None  # [num_decodes] int64
    prefills: list[PrefillChunk]
    block_tables: np.ndarray  # [num_seqs, max_blocks] int64, each row's used prefix is the sequence's table
    # Per-step tensors derived lazily at first use (they need head counts) and reused by every layer.
    _derived: dict[tuple, paddle.Tensor] = field(default_factory=dict, repr=False)

    def derived(self, key: tuple, build: Any) -> paddle.Tensor:
        """Return the tensor cached under ``key``, building it with ``build()`` on first use."""
        tensor = self._derived.get(key)
        if tensor is None:
            tensor = build()
            self._derived[key] = tensor
        return tensor


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> AttentionMetadata:
    """Metadata for a step in which sequence ``i`` computes positions
    ``context_lens[i] - query_lens[i] .. context_lens[i] - 1``.

    Decode sequences (``query_len == 1``) must come first; raises ValueError otherwise,
    or when a block table does not cover its context.
    """
    _validate_step(query_lens, context_lens, block_tables, block_size)
    num_decodes = _leading_decodes(query_lens)
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    prefills: list[PrefillChunk] = []
    query_start = 0
    for index, (query_len, context_len) in enumerate(zip(query_lens, context_lens)):
        table = np.asarray(block_tables[index], dtype=np.int64)
        seq_positions = np.arange(context_len - query_len, context_len, dtype=np.int64)
        positions.append(seq_positions)
        slots.append(_slots_of(table, seq_positions, block_size))
        if index >= num_decodes:
            prefix = None
            if context_len > query_len:
                prefix = _slots_of(table, np.arange(context_len, dtype=np.int64), block_size)
            prefills.append(PrefillChunk(query_start, query_len, context_len, prefix))
        query_start += query_len

    decode_tables, decode_context_lens = None, None
    if num_decodes:
        decode_context_lens = np.asarray(context_lens[:num_decodes], dtype=np.int64)
        decode_tables = _padded_decode_tables(block_tables[:num_decodes], decode_context_lens, block_size)

    ends = np.cumsum(np.asarray(query_lens, dtype=np.int64))
    return AttentionMetadata(
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_size=block_size,
        num_decodes=num_decodes,
        num_tokens=int(ends[-1]),
        positions=paddle.to_tensor(np.concatenate(positions), dtype="int64"),
        slot_mapping=np.concatenate(slots),
        last_token_indices=paddle.to_tensor(ends - 1, dtype="int64"),
        decode_block_tables=decode_tables,
        decode_context_lens=decode_context_lens,
        prefills=prefills,
        block_tables=_padded_tables(block_tables, context_lens, block_size),
    )


def _validate_step(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> None:
    if not query_lens:
        raise ValueError("a step needs at least one sequence")
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError(
            f"query_lens ({len(query_lens)}), context_lens ({len(context_lens)}) and block_tables "
            f"({len(block_tables)}) must have one entry per sequence"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    for index, (query_len, context_len, table) in enumerate(zip(query_lens, context_lens, block_tables)):
        if query_len < 1 or context_len < query_len:
            raise ValueError(f"sequence {index}: need 1 <= query_len <= context_len, got {query_len}, {context_len}")
        needed = -(-context_len // block_size)
        if len(table) < needed:
            raise ValueError(
                f"sequence {index}: context of {context_len} tokens needs {needed} blocks, table has {len(table)}"
            )


def _leading_decodes(query_lens: list[int]) -> int:
    """Number of decode sequences, which must all precede the prefill chunks."""
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    if any(length == 1 for length in query_lens[num_decodes:]):
        raise ValueError("decode sequences (query_len == 1) must be ordered before all prefill chunks")
    return num_decodes


def _slots_of(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return table[positions // block_size] * block_size + positions % block_size


def _padded_tables(block_tables: list[list[int]], context_lens: list[int], block_size: int) -> np.ndarray:
    """[S, max_blocks] block ids; entries past a sequence's context are 0 (the native kernel never reads them)."""
    used = [-(-context_len // block_size) for context_len in context_lens]
    tables = np.zeros((len(block_tables), max(used)), dtype=np.int64)
    for row, (table, count) in enumerate(zip(block_tables, used)):
        tables[row, :count] = table[:count]
    return tables


def _padded_decode_tables(block_tables: list[list[int]], context_lens: np.ndarray, block_size: int) -> np.ndarray:
    """[B, max_blocks] block ids; padding repeats the sequence's first block (real data, masked out later)."""
    num_blocks = -(-int(context_lens.max()) // block_size)
    tables = np.zeros((len(block_tables), num_blocks), dtype=np.int64)
    for row, (table, context_len) in enumerate(zip(block_tables, context_lens)):
        used = table[: -(-int(context_len) // block_size)]
        tables[row, : len(used)] = used
        tables[row, len(used):] = used[0]
    return tables


def _cache_rows(slots: np.ndarray, num_kv_heads: int, block_size: int) -> np.ndarray:
    """Rows of the ``[-1, head_dim]`` cache view holding ``slots`` ([..., L]), as [..., kv_heads, L]."""
    blocks, offsets = slots // block_size, slots % block_size
    heads = np.arange(num_kv_heads, dtype=np.int64)[:, None]
    return (blocks[..., None, :] * num_kv_heads + heads) * block_size + offsets[..., None, :]


# --------------------------------------------------------------------------- attention


def paged_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    meta: AttentionMetadata,
    scale: float,
    native: bool | None = None,
) -> paddle.Tensor:
    """Write the step's k/v ([T, kv_heads, D]) into the cache, then attend q ([T, heads, D]).

    Returns [T, heads * D] in the token order of ``q``. ``native``: None uses the native kernel
    when it is available (FD_NATIVE_KERNELS), True requires it, False runs the Paddle path.
    """
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    # Row views of the cache ([blocks * kv_heads * block_size, D]): the write and the per-token gathers use them.
    k_rows = k_cache.reshape([-1, head_dim])
    v_rows = v_cache.reshape([-1, head_dim])
    write_rows = meta.derived(("write_rows", num_kv_heads), lambda: _write_rows(meta, num_kv_heads))
    k_rows.scatter_(write_rows, k.reshape([-1, head_dim]), overwrite=True)
    v_rows.scatter_(write_rows, v.reshape([-1, head_dim]), overwrite=True)

    if native is None:
        native = use_native_kernel()
    if native:
        starts, lens, contexts, tables = meta.derived(("native_inputs",), lambda: _native_inputs(meta))
        return native_attention.paged_attention(q, k_cache, v_cache, tables, starts, lens, contexts, scale)

    if scale != 1.0:  # the model may have folded the scale into its Q weights
        q = paddle.scale(q, scale)
    outputs = []
    if meta.num_decodes:
        outputs.append(_decode_attention(q[: meta.num_decodes], k_cache, v_cache, meta))
    for chunk in meta.prefills:
        outputs.append(_prefill_attention(q, k, v, k_rows, v_rows, chunk, meta, num_kv_heads))
    return outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=0)


def rope_paged_attention(
    qkv: paddle.Tensor,
    cos_table: paddle.Tensor,
    sin_table: paddle.Tensor,
    positions: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    scale: float,
) -> paddle.Tensor:
    """RoPE, the cache write and attention of one layer as one native call (``fd_rope_paged_attention``).

    ``qkv`` is the fused projection [T, (num_heads + 2 * kv_heads) * D]; the tables are the model's
    [max_positions, D] cos and sign-folded sin. Same result as rotating with Paddle ops and calling
    ``paged_attention`` (bit for bit: the products are rounded before the sum as Paddle does), one op
    instead of about ten per layer. Requires the native kernel (``use_native_kernel()``).
    """
    slots = meta.derived(("slots",), lambda: paddle.to_tensor(np.ascontiguousarray(meta.slot_mapping, dtype=np.int64)))
    starts, lens, contexts, tables = meta.derived(("native_inputs",), lambda: _native_inputs(meta))
    return native_attention.rope_paged_attention(qkv, cos_table, sin_table, positions, slots, k_cache, v_cache,
                                                 tables, starts, lens, contexts, num_heads, scale)


def use_native_kernel() -> bool:
    """True when the native kernel is enabled and built (the build runs on the first call, then is cached)."""
    return kernel_build.native_kernels_enabled() and native_attention.load() is not None


def _native_inputs(meta: AttentionMetadata) -> tuple[paddle.Tensor, ...]:
    """Per-step int64 inputs of the native kernel, shared by all layers."""
    lens = np.asarray(meta.query_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    return (paddle.to_tensor(starts), paddle.to_tensor(lens),
            paddle.to_tensor(np.asarray(meta.context_lens, dtype=np.int64)), paddle.to_tensor(meta.block_tables))


def _write_rows(meta: AttentionMetadata, num_kv_heads: int) -> paddle.Tensor:
    """Rows the step's k/v ([T * kv_heads, D], token-major) are written to."""
    rows = _cache_rows(meta.slot_mapping[:, None], num_kv_heads, meta.block_size)  # [T, kv_heads, 1]
    return paddle.to_tensor(rows.reshape(-1), dtype="int64")


def _per_head_rows(slots: np.ndarray, num_kv_heads: int, block_size: int) -> paddle.Tensor:
    """Row indices into the [-1, D] cache view, ordered [..., kv_head, slot].

    Gathering with these yields K/V already in attention order ([.., kv_heads, len, D]),
    avoiding a 4-D transpose.
    """
    return paddle.to_tensor(_cache_rows(slots, num_kv_heads, block_size).reshape(-1), dtype="int64")


def _decode_block_rows(meta: AttentionMetadata, num_kv_heads: int) -> paddle.Tensor:
    """Rows of the [blocks * kv_heads, block_size * D] cache view, ordered [seq, kv_head, block]."""
    tables = meta.decode_block_tables
    heads = np.arange(num_kv_heads, dtype=np.int64)[:, None]
    return paddle.to_tensor((tables[:, None, :] * num_kv_heads + heads).reshape(-1), dtype="int64")


def _decode_attention(
    q: paddle.Tensor, k_cache: paddle.Tensor, v_cache: paddle.Tensor, meta: AttentionMetadata
) -> paddle.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    length = meta.decode_block_tables.shape[1] * block_size
    rows = meta.derived(("decode_block_rows", num_kv_heads), lambda: _decode_block_rows(meta, num_kv_heads))
    mask = meta.derived(("decode_mask", num_kv_heads, group), lambda: _decode_mask(meta, num_kv_heads, group))
    block_view = [-1, block_size * head_dim]
    keys = paddle.gather(k_cache.reshape(block_view), rows).reshape([batch, num_kv_heads, length, head_dim])
    values = paddle.gather(v_cache.reshape(block_view), rows).reshape([batch, num_kv_heads, length, head_dim])
    # Head h reads KV head h // group: [B, H, D] is [B, kv_heads, group, D] without moving data.
    scores = paddle.matmul(q.reshape([batch, num_kv_heads, group, head_dim]), keys, transpose_y=True)
    probs = F.softmax(scores + mask, axis=-1)
    return paddle.matmul(probs, values).reshape([batch, num_heads * head_dim])


def _decode_mask(meta: AttentionMetadata, num_kv_heads: int, group: int) -> paddle.Tensor:
    length = meta.decode_block_tables.shape[1] * meta.block_size
    beyond = np.arange(length)[None, :] >= meta.decode_context_lens[:, None]
    additive = np.where(beyond, _MASKED, 0.0).astype(np.float32)
    full = np.broadcast_to(additive[:, None, None, :], (len(additive), num_kv_heads, group, length))
    return paddle.to_tensor(np.ascontiguousarray(full))


def _prefill_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    k_rows: paddle.Tensor,
    v_rows: paddle.Tensor,
    chunk: PrefillChunk,
    meta: AttentionMetadata,
    num_kv_heads: int,
) -> paddle.Tensor:
    start, query_len, context_len = chunk.query_start, chunk.query_len, chunk.context_len
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    prefix_len = context_len - query_len
    # Every [tokens, heads, D] <-> [heads, tokens, D] reordering below is a row gather with an index
    # shared by all layers: Paddle's strided copy (transpose + contiguous) was measured 10-50x slower.
    if chunk.context_slots is None:
        rows = meta.derived(
            ("chunk_kv_rows", start, query_len, num_kv_heads),
            lambda: _head_major_rows(start, query_len, num_kv_heads),
        )
        keys = paddle.gather(k.reshape([-1, head_dim]), rows).reshape([num_kv_heads, context_len, head_dim])
        values = paddle.gather(v.reshape([-1, head_dim]), rows).reshape([num_kv_heads, context_len, head_dim])
    else:
        rows = meta.derived(
            ("prefix_rows", start, num_kv_heads),
            lambda: _per_head_rows(chunk.context_slots, num_kv_heads, meta.block_size),
        )
        keys = paddle.gather(k_rows, rows).reshape([num_kv_heads, context_len, head_dim])
        values = paddle.gather(v_rows, rows).reshape([num_kv_heads, context_len, head_dim])

    q_rows = q.reshape([-1, head_dim])
    tile = min(_PREFILL_QUERY_TILE, max(1, _PREFILL_SCORE_BUDGET // (num_heads * context_len)))
    outputs = []
    for tile_start in range(0, query_len, tile):
        tile_len = min(tile, query_len - tile_start)
        # Keys after the tile's last query are masked for every query in it: leave them out.
        visible = prefix_len + tile_start + tile_len
        tile_keys = keys if visible == context_len else keys[:, :visible]
        tile_values = values if visible == context_len else values[:, :visible]
        # [tile, H, D] -> [H, tile, D] is [kv_heads, group * tile, D]: one matmul per KV head group.
        tile_rows = meta.derived(
            ("query_tile_rows", start + tile_start, tile_len, num_heads),
            lambda: _head_major_rows(start + tile_start, tile_len, num_heads),
        )
        q_tile = paddle.gather(q_rows, tile_rows).reshape([num_kv_heads, group * tile_len, head_dim])
        scores = paddle.matmul(q_tile, tile_keys, transpose_y=True).reshape([num_heads, tile_len, visible])
        mask = meta.derived(
            ("prefill_mask", start, tile_start), lambda: _prefill_mask(prefix_len + tile_start, tile_len, visible)
        )
        probs = F.softmax(scores + mask, axis=-1).reshape([num_kv_heads, group * tile_len, visible])
        outputs.append(paddle.matmul(probs, tile_values).reshape([num_heads, tile_len, head_dim]))
    out = outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=1)
    out_rows = meta.derived(("chunk_out_rows", query_len, num_heads), lambda: _head_major_rows(0, num_heads, query_len))
    return paddle.gather(out.reshape([-1, head_dim]), out_rows).reshape([query_len, num_heads * head_dim])


def _head_major_rows(first: int, count: int, width: int) -> paddle.Tensor:
    """Rows of a [tokens, width, D] tensor seen as [tokens * width, D] that list tokens
    ``first .. first + count - 1`` in [width, count] order (a transpose by gather).

    Called as ``_head_major_rows(0, width, count)`` it is the inverse: [width, count] back
    to [count, width].
    """
    tokens = np.arange(first, first + count, dtype=np.int64)
    return paddle.to_tensor((tokens[None, :] * width + np.arange(width, dtype=np.int64)[:, None]).reshape(-1))


def _prefill_mask(first_position: int, tile_len: int, context_len: int) -> paddle.Tensor:
    """[tile, context] additive mask: the query at position p attends keys 0..p (bottom-right aligned).

    Kept 2-D (broadcast over heads): at prefill sizes the broadcast costs little next to
    the matmuls, and a per-head copy would multiply the mask's memory by the head count.
    """
    query_positions = np.arange(first_position, first_position + tile_len)[:, None]
    additive = np.where(np.arange(context_len)[None, :] > query_positions, _MASKED, 0.0).astype(np.float32)
    return paddle.to_tensor(additive)
