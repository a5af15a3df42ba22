"""The native paged-attention kernel against the Paddle path of worker/attention.py (the fallback).

Random steps over a paged cache with scattered blocks: decode batches, prefill chunks with and
without a cached prefix, mixed steps, partial last blocks, GQA groups 1..4, kv_heads 1..4,
contexts up to 2k, head sizes 64 (the SmolLM2 size), 128 and 40 (the generic-size path).
The first test builds the kernel (cold: ~15-40 s; later runs load it from the cache).
"""
from __future__ import annotations

import envs

envs.apply_compute_thread_env(2)

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402

from worker import attention  # noqa: E402
from worker.kernels import build, paged_attention as native  # noqa: E402

TOLERANCE = 1e-5


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if envs.FD_NATIVE_KERNELS == "0":
        pytest.skip("FD_NATIVE_KERNELS=0")
    if build._compiler() is None:
        pytest.skip("no C++ compiler: the Paddle fallback is what runs here (tests/test_kernels_build.py covers it)")
    module = native.load()
    if module is None:
        pytest.fail(f"native paged attention did not build: {build.last_build('fd_paged_attention_ext')}")
    return module


def _random_step(rng, query_lens, context_lens, kv_heads, group, head_dim, block_size):
    """(q, k, v, k_cache, v_cache, meta) with every sequence's blocks scattered over a shared pool."""
    used = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(used) + 3
    pool = rng.permutation(num_blocks)
    tables, offset = [], 0
    for count in used:
        tables.append(pool[offset: offset + count].tolist())
        offset += count
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    v_cache = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    tokens = sum(query_lens)
    heads = kv_heads * group
    q = paddle.to_tensor(rng.standard_normal((tokens, heads, head_dim)).astype(np.float32))
    k = paddle.to_tensor(rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32))
    v = paddle.to_tensor(rng.standard_normal((tokens, kv_heads, head_dim)).astype(np.float32))
    meta = attention.build_attention_metadata(query_lens, context_lens, tables, block_size)
    return q, k, v, k_cache, v_cache, meta


def _compare(query_lens, context_lens, kv_heads, group, head_dim=64, block_size=16, seed=0, scale=None):
    rng = np.random.default_rng(seed)
    q, k, v, k_cache, v_cache, meta = _random_step(rng, query_lens, context_lens, kv_heads, group, head_dim,
                                                   block_size)
    scale = head_dim ** -0.5 if scale is None else scale
    expected = attention.paged_attention(q, k, v, k_cache, v_cache, meta, scale, native=False).numpy()
    got = attention.paged_attention(q, k, v, k_cache, v_cache, meta, scale, native=True).numpy()
    assert got.shape == expected.shape == (sum(query_lens), kv_heads * group * head_dim)
    diff = float(np.abs(got - expected).max())
    assert diff < TOLERANCE, f"max abs diff {diff} for q {query_lens} ctx {context_lens} kvh {kv_heads} g {group}"


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (1, 4), (2, 3), (3, 3), (4, 2)])
def test_decode_batch_matches_paddle(kv_heads, group):
    rng = np.random.default_rng(kv_heads * 10 + group)
    contexts = [1, 2, 15, 16, 17, 64, 129] + rng.integers(1, 2048, size=5).tolist()
    _compare([1] * len(contexts), contexts, kv_heads, group, seed=kv_heads + group)


@pytest.mark.parametrize("query_len,prefix", [(1 + 1, 0), (7, 0), (33, 0), (100, 0), (40, 25), (64, 1000), (5, 2043)])
def test_prefill_chunk_matches_paddle(query_len, prefix):
    _compare([query_len], [prefix + query_len], kv_heads=3, group=3, seed=query_len + prefix)


def test_mixed_step_matches_paddle():
    # decodes first, then two prefill chunks (one following a cached prefix), partial last blocks
    _compare([1, 1, 1, 37, 70], [5, 300, 1025, 37, 170], kv_heads=2, group=2, block_size=64, seed=7)


@pytest.mark.parametrize("head_dim", [128, 96, 80, 40, 36])
def test_other_head_sizes_match_paddle(head_dim):
    _compare([1, 1, 50], [77, 513, 90], kv_heads=2, group=4, head_dim=head_dim, seed=head_dim)


def test_long_prefill_matches_paddle():
    _compare([1, 2048], [900, 2048], kv_heads=1, group=3, block_size=64, seed=3)


def test_scale_one_with_prescaled_queries():
    _compare([1, 20], [40, 60], kv_heads=2, group=2, scale=1.0, seed=11)


def test_fallback_when_disabled(monkeypatch):
    monkeypatch.setenv("FD_NATIVE_KERNELS", "0")
    assert attention.use_native_kernel() is False
    assert native.load() is None
    monkeypatch.setenv("FD_NATIVE_KERNELS", "auto")
    assert attention.use_native_kernel() is True
    assert native.load() is not None


def test_bad_block_id_is_an_error_not_a_crash():
    rng = np.random.default_rng(0)
    q, k, v, k_cache, v_cache, meta = _random_step(rng, [1], [20], 1, 1, 64, 16)
    meta.block_tables[0, 1] = 10_000
    with pytest.raises(Exception, match="block id out of range"):
        attention.paged_attention(q, k, v, k_cache, v_cache, meta, 0.125, native=True)
