"""Python side of the fused elementwise kernels (``fused_ops.cc``): residual add + RMSNorm, and SwiGLU.

Owns loading the operators (through ``build.load_extension``, once per process) and their call
signatures. ``available()`` is False when the kernels cannot be used (FD_NATIVE_KERNELS=0, no
AVX-512F, no compiler, a failed build); callers then keep their Paddle ops.
"""
from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import paddle

from worker.kernels import build

logger = logging.getLogger(__name__)

REQUIRED_CPU_FLAGS = ("avx512f",)
_EXTENSION = build.Extension("fd_fused_ops", [Path(__file__).with_name("fused_ops.cc")],
                             required_cpu_flags=REQUIRED_CPU_FLAGS)


def load() -> ModuleType | None:
    """The extension module, built or taken from the cache on first call; None if unavailable."""
    return _EXTENSION.load()


def available() -> bool:
    return _EXTENSION.available()


def _require() -> ModuleType:
    module = load()
    if module is None:
        raise build.NativeKernelUnavailable("fd_fused_ops is not available (see the log for why)")
    return module


def fused_add_rms_norm(
    x: paddle.Tensor, residual: paddle.Tensor, weight: paddle.Tensor, eps: float
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) over the last dimension, float32."""
    normed, summed = _require().fd_add_rms_norm(x, residual, weight, float(eps))
    return normed, summed


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """rms_norm(x) * weight over the last dimension, float32."""
    return _require().fd_rms_norm(x, weight, float(eps))


def silu_and_mul(gate_up: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up where gate | up are the two halves of the last dimension (F.swiglu's single-input split)."""
    return _require().fd_silu_and_mul(gate_up)
