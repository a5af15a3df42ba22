"""Linear-layer GEMM micro-benchmark: float32 and bfloat16 ways to run the model's matmuls on this CPU.

This script owns the per-shape measurement behind ``--dtype`` and the native GEMM choice (issue 15).
For each of SmolLM2-135M's linear shapes ([M, in] x [in, out]: fused QKV, o_proj, gate_up, down and
the LM head, with the model's zero-column padding) and each M (tokens in the step), it times,
alternating the variants round by round:

- ``paddle_fp32``: ``paddle.matmul`` (MKL), what the float32 model runs;
- ``paddle_fp32_mkldnn``: the same with ``FLAGS_use_mkldnn`` on;
- ``onednn_sgemm``: oneDNN's float32 ``dnnl_sgemm`` from Paddle's ``libdnnl.so.3`` (ctypes on numpy);
- ``onednn_bf16``: oneDNN's ``dnnl_gemm_bf16bf16f32`` (ctypes; x already in bf16, so this
  excludes the float32 -> bf16 conversion ``fd_bf16`` includes);
- ``fd_bf16``: the ``fd_bf16_linear`` custom operator (worker/kernels/gemm_bf16.cc) on packed weights,
  what ``--dtype bfloat16`` runs (x converted to bf16 inside, float32 output).

``--int8`` adds ``fd_int8`` at every M, the experimental ``fd_int8_linear`` operator (worker/kernels/gemm_int8.cc:
int8 weights per output column, x quantised per row inside, AVX512-VNNI ``vpdpbusd``, float32 output), and at
M = 1 oneDNN's integer GEMMs ``dnnl_gemm_u8s8s32`` and ``dnnl_gemm_s8s8s32`` (int32 output, no
quantisation or scaling included): the weight-read bound of an 8-bit weight mode.

oneDNN's matmul primitive (pre-packed weights, per-shape primitive cache) is not measured: Paddle's
wheel ships ``libdnnl.so.3`` (oneDNN 3.6) but not its real headers (the shipped ``dnnl.h`` includes
an absent ``oneapi/dnnl/dnnl.h``), and the primitive API needs the header's enum values.

    python benchmarks/gemm.py [--m 1,8,32,128,512] [--int8] [--out benchmarks/results/gemm.json]

Times are per call in microseconds: the median over ``--rounds`` rounds of the mean of ``--reps`` calls,
by wall clock, or with ``--clock cpu`` by this process's CPU time (use with ``--threads 1``: the figure
is then the work itself, much steadier than wall time while other jobs share the cores).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import statistics
import time
from typing import Any, Callable

from model_setup import write_report

import envs

logger = logging.getLogger(__name__)

# SmolLM2-135M (hidden 576, 9 + 2 x 3 heads of 64, intermediate 1536): [in, out] as llama.py stores them.
SHAPES = {
    "qkv": (576, 960),
    "o_proj": (576, 576),
    "gate_up": (576, 3104),  # 2 x 1536 + 32 zero columns (llama.py _padded_mlp)
    "down": (1552, 576),
    "lm_head": (576, 49184),  # 49152 + 32 zero columns (llama.py _pad_columns)
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,8,32,128,512", help="comma-separated row counts (tokens per step)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per shape and M")
    parser.add_argument("--reps", type=int, default=10, help="calls per variant per round")
    parser.add_argument("--int8", action="store_true", help="also time oneDNN's int8 GEMMs at M = 1")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0: FD_NUM_THREADS or all cores)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (with --threads 1, the work itself, "
                             "steadier than wall time on a machine shared with other jobs)")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    args.m = [int(item) for item in args.m.split(",") if item.strip()]
    args.shapes = [item for item in args.shapes.split(",") if item.strip()]
    unknown = set(args.shapes) - set(SHAPES)
    if unknown or not args.m or min(args.m) < 1:
        parser.error(f"bad --m or unknown shapes {sorted(unknown)}")
    return args


def _onednn_library() -> ctypes.CDLL:
    import paddle

    library = ctypes.CDLL(os.path.join(os.path.dirname(paddle.__file__), "libs", "libdnnl.so.3"))
    i64, ptr, char, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_char, ctypes.c_float
    plain = [char, char, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64]
    library.dnnl_sgemm.argtypes = plain
    library.dnnl_gemm_bf16bf16f32.argtypes = plain
    # (transa, transb, offsetc, M, N, K, alpha, A, lda, ao, B, ldb, bo, beta, C, ldc, co)
    integer = [char, char, char, i64, i64, i64, f32, ptr, i64, ctypes.c_int8, ptr, i64, ctypes.c_int8, f32, ptr, i64,
               ptr]
    library.dnnl_gemm_u8s8s32.argtypes = [*integer[:9], ctypes.c_uint8, *integer[10:]]
    library.dnnl_gemm_s8s8s32.argtypes = integer
    for function in (library.dnnl_sgemm, library.dnnl_gemm_bf16bf16f32, library.dnnl_gemm_u8s8s32,
                     library.dnnl_gemm_s8s8s32):
        function.restype = ctypes.c_int
    return library


def _variants(
    rows: int, k: int, n: int, onednn: ctypes.CDLL, bf16: Any, int8: Any
) -> dict[str, Callable[[], Any]]:
    """Name -> zero-argument call, each computing [rows, k] x [k, n] on the same data."""
    import numpy as np
    import paddle

    from worker.kernels import gemm

    rng = np.random.default_rng(0)
    # The ctypes calls take the arrays' addresses at call time (``.ctypes.data`` in the lambdas), which also keeps
    # the arrays alive as long as the calls.
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32) * np.float32(0.05)
    out = np.zeros((rows, n), dtype=np.float32)
    x_t, w_t = paddle.to_tensor(x), paddle.to_tensor(w)
    x_bits, w_bits = gemm.to_bf16_bits(x), gemm.to_bf16_bits(w)

    def mkldnn_matmul() -> Any:
        paddle.set_flags({"FLAGS_use_mkldnn": True})
        try:
            return paddle.matmul(x_t, w_t)
        finally:
            paddle.set_flags({"FLAGS_use_mkldnn": False})

    variants: dict[str, Callable[[], Any]] = {"paddle_fp32": lambda: paddle.matmul(x_t, w_t),
                                              "paddle_fp32_mkldnn": mkldnn_matmul}
    if bf16 is not None:
        packed = gemm.pack_bf16(w)
        variants["fd_bf16"] = lambda: gemm.bf16_linear(bf16, x_t, packed)
    variants["onednn_sgemm"] = lambda: onednn.dnnl_sgemm(b"N", b"N", rows, n, k, 1.0, x.ctypes.data, k, w.ctypes.data,
                                                         n, 0.0, out.ctypes.data, n)
    variants["onednn_bf16"] = lambda: onednn.dnnl_gemm_bf16bf16f32(b"N", b"N", rows, n, k, 1.0, x_bits.ctypes.data,
                                                                   k, w_bits.ctypes.data, n, 0.0, out.ctypes.data, n)
    if int8 is not None and int8 is not False:
        packed_int8 = gemm.pack_int8(w)
        variants["fd_int8"] = lambda: gemm.int8_linear(int8, x_t, packed_int8)
    if int8 is not False and rows == 1:
        x_u8 = rng.integers(0, 255, size=(rows, k), dtype=np.uint8)
        x_s8 = rng.integers(-127, 127, size=(rows, k), dtype=np.int8)
        w_s8 = rng.integers(-127, 127, size=(k, n), dtype=np.int8)
        acc = np.zeros((rows, n), dtype=np.int32)
        offset = np.zeros(1, dtype=np.int32)
        variants["onednn_u8s8s32"] = lambda: onednn.dnnl_gemm_u8s8s32(
            b"N", b"N", b"F", rows, n, k, 1.0, x_u8.ctypes.data, k, 0, w_s8.ctypes.data, n, 0, 0.0,
            acc.ctypes.data, n, offset.ctypes.data)
        variants["onednn_s8s8s32"] = lambda: onednn.dnnl_gemm_s8s8s32(
            b"N", b"N", b"F", rows, n, k, 1.0, x_s8.ctypes.data, k, 0, w_s8.ctypes.data, n, 0, 0.0,
            acc.ctypes.data, n, offset.ctypes.data)
    return variants


def time_variants(
    variants: dict[str, Callable[[], Any]], rounds: int, reps: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Median over rounds of the mean per-call time (us) by ``clock``; variants alternate inside every round."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for call in variants.values():
        call()  # warm-up: first-call allocations, oneDNN's JIT
    for _ in range(rounds):
        for name, call in variants.items():
            started = clock()
            for _ in range(reps):
                call()
            samples[name].append((clock() - started) / reps * 1e6)
    return {name: round(statistics.median(values), 1) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=envs.FD_LOG_LEVEL, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threads = args.threads or envs.FD_NUM_THREADS or envs.available_cores()
    envs.apply_compute_thread_env(threads)
    from worker.kernels import gemm

    bf16 = gemm.bf16_gemm_module()
    # --int8: the experimental fd_int8_linear module (None where it cannot run: the oneDNN int8 GEMMs still run).
    int8 = gemm.int8_gemm_module() if args.int8 else False
    onednn = _onednn_library()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    results = []
    for shape in args.shapes:
        k, n = SHAPES[shape]
        for rows in args.m:
            variants = _variants(rows, k, n, onednn, bf16, int8)
            timings = time_variants(variants, args.rounds, args.reps, clock)
            logger.info("%s M=%d: %s", shape, rows, timings)
            ratios = {name: round(timings["paddle_fp32"] / value, 2) for name, value in timings.items()}
            results.append({"shape": shape, "m": rows, "k": k, "n": n, "us": timings, "speedup_vs_paddle_fp32": ratios})
    report = {"threads": threads, "clock": args.clock, "rounds": args.rounds, "reps": args.reps,
              "fd_bf16_available": bf16 is not None, "results": results}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
