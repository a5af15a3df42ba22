"""The bf16 GEMM custom operator (worker/kernels/gemm_bf16.cc) against numpy, its refusals, and --dtype checks.

The kernel is compared with a float64 product of the same bf16-rounded inputs (tight: only the float32
accumulation order differs) and with the float32 product of the unrounded inputs (bf16 tolerance).
The model-level check runs a tiny dense checkpoint in both dtypes. Skipped where the CPU has no
AVX512-BF16 or the kernel does not build (the refusal tests run everywhere).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import envs
from config.engine_config import ConfigError, EngineArgs, validate_args
from worker.kernels import gemm

needs_kernel = pytest.mark.skipif(
    not all(flag in envs.cpu_flags() for flag in gemm.REQUIRED_CPU_FLAGS), reason="CPU lacks AVX512-BF16"
)


@pytest.fixture(scope="module")
def kernel():
    module = gemm.bf16_gemm_module()
    if module is None:
        pytest.skip("the bf16 GEMM kernel did not build here (see the build log in the kernel cache)")
    return module


def _bf16_reference(x: np.ndarray, weight: gemm.PackedBf16) -> np.ndarray:
    x_rounded = gemm.from_bf16_bits(gemm.to_bf16_bits(x)).astype(np.float64)
    return x_rounded @ gemm.unpack_bf16(weight).astype(np.float64)


def test_bf16_rounding_is_round_to_nearest_even():
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 3.0e38, 1.0e-40], dtype=np.float32)
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: it goes to the even mantissa (1.0); 1 + 3*2^-8 goes up.
    rounded = gemm.from_bf16_bits(gemm.to_bf16_bits(values))
    np.testing.assert_array_equal(rounded[:4], np.array([1.0, 1.0, 1.0 + 2**-6, -2.5], dtype=np.float32))
    assert abs(rounded[4] - values[4]) / values[4] < 2**-8


@pytest.mark.parametrize("k,n", [(576, 960), (7, 17), (1552, 576), (64, 49), (33, 3104)])
def test_pack_roundtrip(k, n):
    weight = np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32)
    packed = gemm.pack_bf16(weight)
    assert packed.packed.shape == [-(-n // 64), -(-k // 2), 128]
    np.testing.assert_array_equal(gemm.unpack_bf16(packed), gemm.from_bf16_bits(gemm.to_bf16_bits(weight)))


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (3, 7, 17), (5, 1552, 576), (9, 576, 3104), (33, 64, 49),
                                   (130, 576, 160), (1, 576, 49152)])
def test_gemm_matches_numpy(kernel, m, k, n):
    import paddle

    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    weight = gemm.pack_bf16((rng.standard_normal((k, n)) * 0.05).astype(np.float32))
    out = gemm.bf16_linear(kernel, paddle.to_tensor(x), weight).numpy()
    assert out.shape == (m, n) and out.dtype == np.float32
    exact = _bf16_reference(x, weight)
    # Same bf16 inputs: only float32 accumulation (k products) separates the kernel from float64.
    np.testing.assert_allclose(out, exact, rtol=0, atol=1e-5 * np.sqrt(k) * np.abs(exact).max() + 1e-6)
    # Against the unrounded float32 product: bf16's 8-bit mantissa on both inputs.
    plain = x.astype(np.float64) @ gemm.unpack_bf16(weight).astype(np.float64)
    assert np.abs(out - plain).max() < 2e-2 * np.abs(plain).max()


@needs_kernel
def test_gemm_rows_do_not_depend_on_the_batch(kernel):
    """A row's result is the same alone or among others (greedy output must not depend on batching)."""
    import paddle

    rng = np.random.default_rng(1)
    x = rng.standard_normal((11, 576)).astype(np.float32)
    weight = gemm.pack_bf16(rng.standard_normal((576, 200)).astype(np.float32))
    batch = gemm.bf16_linear(kernel, paddle.to_tensor(x), weight).numpy()
    for row in (0, 4, 10):
        alone = gemm.bf16_linear(kernel, paddle.to_tensor(x[row:row + 1]), weight).numpy()
        np.testing.assert_array_equal(alone[0], batch[row])


@needs_kernel
def test_gemm_interleaved_with_paddle_matmul(kernel):
    """The operator's OpenMP threads and Paddle's MKL matmuls alternate many times without harm."""
    import paddle

    rng = np.random.default_rng(2)
    x = paddle.to_tensor(rng.standard_normal((32, 576)).astype(np.float32))
    dense = paddle.to_tensor(rng.standard_normal((576, 576)).astype(np.float32))
    weight = gemm.pack_bf16(rng.standard_normal((576, 576)).astype(np.float32))
    first = gemm.bf16_linear(kernel, x, weight).numpy()
    for _ in range(200):
        paddle.matmul(x, dense)
        out = gemm.bf16_linear(kernel, x, weight)
    np.testing.assert_array_equal(out.numpy(), first)


@needs_kernel
def test_tiny_model_bf16_close_to_float32(kernel, tmp_path):
    """A tiny dense checkpoint: bf16 logits close to float32's, and the weights really are bf16."""
    import paddle

    from config.model_config import load_model_config
    from scripts.make_tiny_dense import make_tiny_dense
    from worker.attention import build_attention_metadata, kv_cache_views
    from cache_manager.kv_layout import device_cache_shape
    from worker.loader import load_weights
    from worker.models import get_model_class

    config = load_model_config(make_tiny_dense(str(tmp_path / "tiny"), with_tokenizer=False))
    weights = load_weights(config)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, size=24).astype(np.int64)
    logits = {}
    for dtype in ("float32", "bfloat16"):
        typed = dataclasses.replace(config, dtype=dtype)
        model = get_model_class(typed.architecture)(typed)
        model.load_weights(weights)
        cache = np.zeros(device_cache_shape(typed, 1, 32), dtype=np.float32)
        meta = build_attention_metadata([len(tokens)], [len(tokens)], [[0]], 32)
        with paddle.no_grad():
            hidden = model(paddle.to_tensor(tokens), meta.positions, kv_cache_views(cache), meta)
            logits[dtype] = model.compute_logits(hidden).numpy()
        if dtype == "bfloat16":
            assert isinstance(model._lm_head, gemm.PackedBf16)
    assert logits["bfloat16"].shape == logits["float32"].shape == (len(tokens), config.vocab_size)
    error = np.abs(logits["bfloat16"] - logits["float32"]).max()
    scale = np.abs(logits["float32"]).max()
    assert 0 < error < 0.05 * scale, (error, scale)


@pytest.mark.skipif(not all(flag in envs.cpu_flags() for flag in gemm.INT8_CPU_FLAGS), reason="CPU lacks VNNI")
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (5, 7, 17), (9, 1552, 576)])
def test_experimental_int8_gemm_matches_numpy(m, k, n):
    """fd_int8_linear (benchmark-only so far) against numpy on the same quantised values."""
    import paddle

    module = gemm.int8_gemm_module()
    if module is None:
        pytest.skip("the int8 kernel did not build here")
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    out = gemm.int8_linear(module, paddle.to_tensor(x), gemm.pack_int8(w)).numpy()
    # Reference: the same per-column weight and per-row activation quantisation, in float64.
    w_scale = np.abs(w).max(axis=0) / 127.0
    x_scale = np.abs(x).max(axis=1, keepdims=True) / 127.0
    expected = (np.rint(x / x_scale) * x_scale) @ (np.rint(w / w_scale) * w_scale)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-4 * np.abs(expected).max())
    assert np.abs(out - x @ w).max() < 0.03 * np.abs(x @ w).max()


# ------------------------------------------------------------------ refusals


def test_refused_when_native_kernels_are_off(monkeypatch):
    monkeypatch.setenv("FD_NATIVE_KERNELS", "0")
    if not all(flag in envs.cpu_flags() for flag in gemm.REQUIRED_CPU_FLAGS):
        pytest.skip("the CPU check refuses first here")
    with pytest.raises(gemm.Bf16Unavailable, match="native bf16 GEMM kernel.*FD_NATIVE_KERNELS=0.*--dtype float32"):
        gemm.require_bf16_gemm()


def test_refused_on_a_cpu_without_avx512_bf16(monkeypatch):
    flags = frozenset(envs.cpu_flags() - {"avx512_bf16"})
    monkeypatch.setattr(gemm, "cpu_has", lambda *wanted: set(wanted) <= flags)
    with pytest.raises(gemm.Bf16Unavailable, match="lacks avx512_bf16.*--dtype float32"):
        gemm.require_bf16_gemm()
    assert gemm.bf16_gemm_module() is None


def test_dtype_flag_validation(monkeypatch):
    validate_args(EngineArgs(dtype="float32"))
    with pytest.raises(ConfigError, match="--dtype must be one of float32, bfloat16"):
        validate_args(EngineArgs(dtype="float16"))
    monkeypatch.setattr(envs, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw"}))
    with pytest.raises(ConfigError, match="--dtype bfloat16 needs a CPU with AVX512-BF16.*lacks avx512_bf16"):
        validate_args(EngineArgs(dtype="bfloat16"))
    validate_args(EngineArgs(dtype="float32"))  # float32 needs nothing


def test_dtype_flag_refused_with_native_kernels_off(monkeypatch):
    monkeypatch.setattr(envs, "cpu_flags", lambda: frozenset(gemm.REQUIRED_CPU_FLAGS))
    monkeypatch.setenv("FD_NATIVE_KERNELS", "0")
    with pytest.raises(ConfigError, match="FD_NATIVE_KERNELS=0"):
        validate_args(EngineArgs(dtype="bfloat16"))
    monkeypatch.setenv("FD_NATIVE_KERNELS", "auto")
    validate_args(EngineArgs(dtype="bfloat16"))


def test_dtype_cli_choices():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).dtype == "float32"
    assert EngineArgs.from_cli_args(parser.parse_args(["--dtype", "bfloat16"])).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float16"])
