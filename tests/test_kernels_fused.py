"""The fused native kernels (worker/kernels/fused_ops.cc) against the Paddle ops they replace, and the model switch.

Residual add + RMSNorm is compared with Paddle's ``fused_rms_norm`` (and a float64 numpy reference),
SwiGLU with ``F.swiglu`` and float64 numpy, over odd widths and 1..512 rows (both sides of the kernels'
threading threshold). The model check runs a tiny dense checkpoint with the kernels on and off and
compares the hidden states. Skipped where the kernels do not build (CPU without AVX-512F, no compiler).
"""
from __future__ import annotations

import numpy as np
import paddle
import paddle.incubate.nn.functional as incubate_F
import paddle.nn.functional as F
import pytest

from worker.kernels import fused_ops


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if not fused_ops.available():
        pytest.skip("the fused native kernels are unavailable here (FD_NATIVE_KERNELS=0, CPU or build)")


def _tensor(array: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.ascontiguousarray(array, dtype=np.float32))


def _rms_norm_reference(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * weight.astype(np.float64)


def _swiglu_reference(gate_up: np.ndarray) -> np.ndarray:
    gate, up = np.split(gate_up.astype(np.float64), 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 33), (32, 576), (7, 1), (129, 960), (512, 576), (512, 17)])
def test_add_rms_norm_matches_paddle(rows, hidden):
    rng = np.random.default_rng(rows * 1000 + hidden)
    x = rng.standard_normal((rows, hidden)).astype(np.float32) * 3
    residual = rng.standard_normal((rows, hidden)).astype(np.float32)
    weight = rng.standard_normal(hidden).astype(np.float32)
    eps = 1e-5
    normed, summed = fused_ops.fused_add_rms_norm(_tensor(x), _tensor(residual), _tensor(weight), eps)
    expected_normed, expected_summed = incubate_F.fused_rms_norm(
        _tensor(x), _tensor(weight), None, eps, 1, residual=_tensor(residual))
    np.testing.assert_array_equal(summed.numpy(), expected_summed.numpy())
    np.testing.assert_allclose(normed.numpy(), expected_normed.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(normed.numpy(), _rms_norm_reference(x + residual, weight, eps), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 576), (5, 3, 64), (300, 31)])
def test_rms_norm_matches_paddle(shape):
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(np.float32)
    weight = rng.standard_normal(shape[-1]).astype(np.float32)
    normed = fused_ops.rms_norm(_tensor(x), _tensor(weight), 1e-6)
    expected = incubate_F.fused_rms_norm(_tensor(x), _tensor(weight), None, 1e-6, len(shape) - 1)[0]
    assert normed.shape == list(shape)
    np.testing.assert_allclose(normed.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,intermediate", [(1, 1536), (2, 1), (32, 1536), (17, 1552), (512, 1536), (512, 37)])
def test_silu_and_mul_matches_paddle(rows, intermediate):
    rng = np.random.default_rng(rows * 7 + intermediate)
    gate_up = (rng.standard_normal((rows, 2 * intermediate)) * 4).astype(np.float32)
    out = fused_ops.silu_and_mul(_tensor(gate_up)).numpy()
    assert out.shape == (rows, intermediate)
    np.testing.assert_allclose(out, F.swiglu(_tensor(gate_up)).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, _swiglu_reference(gate_up), rtol=1e-6, atol=1e-6)


def test_silu_and_mul_extremes():
    # Large |gate| saturates silu to gate (positive) or 0 (negative) without inf/nan from exp's range.
    gate = np.array([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1e-30]], dtype=np.float32)
    gate_up = np.concatenate([gate, np.full_like(gate, 2.0)], axis=1)
    out = fused_ops.silu_and_mul(_tensor(gate_up)).numpy()
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, _swiglu_reference(gate_up), rtol=1e-6, atol=1e-30)


def test_refuses_mismatched_inputs():
    x = _tensor(np.ones((2, 8)))
    with pytest.raises(Exception, match="residual shape"):
        fused_ops.fused_add_rms_norm(x, _tensor(np.ones((2, 4))), _tensor(np.ones(8)), 1e-6)
    with pytest.raises(Exception, match="even"):
        fused_ops.silu_and_mul(_tensor(np.ones((2, 7))))


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_model_logits_match_paddle_ops(architecture, monkeypatch):
    """A tiny model (qwen3: also the per-head q/k norms) with the kernels gives Paddle's-ops logits, and uses them."""
    import worker.models.llama as llama_module
    from tests.test_model import logits_of_schedule, random_weights, tiny_config
    from worker.models import get_model_class

    config = tiny_config(architecture, tie=False)
    weights = random_weights(config, seed=5)
    models = {}
    for name, switch in (("native", None), ("paddle", False)):
        monkeypatch.setattr(llama_module, "NATIVE_FUSED_OPS", switch)
        models[name] = get_model_class(architecture)(config)
        models[name].load_weights(weights)
    assert models["native"].native_fused and not models["paddle"].native_fused
    tokens = np.random.default_rng(9).integers(0, config.vocab_size, 12).tolist()
    np.testing.assert_allclose(logits_of_schedule(models["native"], config, tokens, prefill=7),
                               logits_of_schedule(models["paddle"], config, tokens, prefill=7), rtol=1e-5, atol=1e-5)
