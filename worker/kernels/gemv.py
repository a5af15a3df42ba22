"""Python side of the float32 few-row linear kernel (``gemv_f32.cc``): decode steps' matmuls.

Owns loading the operator and the choice of when it runs: ``small_linear(x, w)`` is ``x @ w`` for
x with 1 to ``MAX_ROWS`` rows, by the native op where it is available, streaming ``w`` (the usual
[in, out] float32 weight, unchanged) with every core; ``None`` tells the caller to use
``paddle.matmul`` (more rows, no kernel). The crossover is measured
(``python benchmarks/few_row_linear.py``): at these row counts the layer is bound by reading the
weights, and MKL reads them with about one core's bandwidth.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

import paddle

from worker.kernels import build

REQUIRED_CPU_FLAGS = ("avx512f",)
MAX_ROWS = 8  # gemv_f32.cc kMaxRows
_EXTENSION = build.Extension("fd_gemv_f32", [Path(__file__).with_name("gemv_f32.cc")],
                             required_cpu_flags=REQUIRED_CPU_FLAGS)


def load() -> ModuleType | None:
    """The extension module, built or taken from the cache on first call; None if unavailable."""
    return _EXTENSION.load()


def available() -> bool:
    return _EXTENSION.available()


def small_linear(x: paddle.Tensor, weight: paddle.Tensor, max_rows: int = MAX_ROWS) -> paddle.Tensor | None:
    """x [M, K] @ weight [K, N] float32 by the native op when 1 <= M <= max_rows and it is available, else None."""
    rows = x.shape[0]
    if rows < 1 or rows > min(max_rows, MAX_ROWS):
        return None
    module = load()
    if module is None:
        return None
    return module.fd_f32_small_linear(x, weight)
