"""Micro-benchmark of the fused native elementwise kernels (worker/kernels/fused_ops.cc) against Paddle's ops.

This script owns the per-call timing table of the fused ops of issue 15: residual add + RMSNorm
(``fd_add_rms_norm`` vs ``incubate fused_rms_norm(residual=...)``) over [rows, hidden] and SwiGLU
(``fd_silu_and_mul`` vs ``F.swiglu``) over [rows, 2 * intermediate], SmolLM2-135M shapes by default.
The two variants alternate call by call (load on the shared machine hits both alike); medians in
microseconds and the speed-up are reported, as a table on stderr and JSON on stdout.

    python benchmarks/fused_ops.py [--rows 1,32,512] [--hidden 576] [--intermediate 1536] [--repeats 200]

``native_alone_us`` times the native op in its own loop too: interleaved with a Paddle op that leaves its
OpenMP threads spinning, a multi-threaded native call can wait for a core (the model runs MKL, on the same
runtime, between these ops instead). ``--profile-rounds N`` then runs ``benchmarks/profile_step.py``
(SmolLM2-135M decode step, ``--batch-size`` / ``--context``) N times per variant, alternating
``llama.NATIVE_FUSED_OPS`` False / None, and reports the medians of the step and of its norm/SwiGLU lines.
``--step-rounds N`` times whole decode steps of one loaded model (model forward + LM head + argmax, as
``bf16_step.py``), switching ``model.native_fused`` step by step, wall and process CPU time medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO_ROOT, os.path.join(REPO_ROOT, "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import envs  # noqa: E402
from model_setup import write_report  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,512", help="comma-separated row counts (tokens per step)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per variant and case")
    parser.add_argument("--threads", type=int, default=0, help="compute threads (0: FD_NUM_THREADS or all cores)")
    parser.add_argument("--out", default=None, help="also write the JSON result to this file")
    parser.add_argument("--profile-rounds", type=int, default=0, help="profile_step runs per variant (0: none)")
    parser.add_argument("--batch-size", type=int, default=32, help="profile_step decode batch")
    parser.add_argument("--context", type=int, default=128, help="profile_step / --step-rounds context")
    parser.add_argument("--step-rounds", type=int, default=0,
                        help="decode steps per variant with one model, toggling model.native_fused step by step")
    parser.add_argument("--step-batch-sizes", default="1,32", help="decode batches of --step-rounds")
    return parser.parse_args(argv)


def time_alternating(variants: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median microseconds per call of each variant, interleaved call by call after warm-up calls."""
    for run in variants.values():
        for _ in range(3):
            run()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(values) * 1e6, 2) for name, values in samples.items()}


def bench_rows(rows: int, hidden: int, intermediate: int, repeats: int) -> list[dict[str, Any]]:
    import numpy as np
    import paddle
    import paddle.incubate.nn.functional as incubate_F
    import paddle.nn.functional as F

    from worker.kernels import fused_ops

    rng = np.random.default_rng(rows)
    x = paddle.to_tensor(rng.standard_normal((rows, hidden)).astype(np.float32))
    residual = paddle.to_tensor(rng.standard_normal((rows, hidden)).astype(np.float32))
    weight = paddle.to_tensor(rng.standard_normal(hidden).astype(np.float32))
    gate_up = paddle.to_tensor(rng.standard_normal((rows, 2 * intermediate)).astype(np.float32))
    cases = {
        "add_rms_norm": {
            "native": lambda: fused_ops.fused_add_rms_norm(x, residual, weight, 1e-5),
            "paddle": lambda: incubate_F.fused_rms_norm(x, weight, None, 1e-5, 1, residual=residual),
        },
        "silu_and_mul": {
            "native": lambda: fused_ops.silu_and_mul(gate_up),
            "paddle": lambda: F.swiglu(gate_up),
        },
    }
    results = []
    for op, variants in cases.items():
        medians = time_alternating(variants, repeats)
        alone = time_alternating({"native": variants["native"]}, repeats)["native"]
        results.append({"op": op, "rows": rows, "native_us": medians["native"], "paddle_us": medians["paddle"],
                        "speedup": round(medians["paddle"] / medians["native"], 2) if medians["native"] else None,
                        "native_alone_us": alone})
    return results


def _norm_swiglu_ms(labels: dict[str, float]) -> dict[str, float]:
    """The profile's labels of the norm and SwiGLU calls (Paddle's or the native ones)."""
    keys = ("rms_norm", "swiglu", "silu_and_mul")
    return {label: value for label, value in labels.items() if any(key in label for key in keys)}


def profile_step_rounds(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    """profile_step.py's decode step with the Paddle ops and the native kernels, alternating run by run."""
    import contextlib
    import io

    import profile_step
    import worker.models.llama as llama

    runs: dict[str, list[dict[str, Any]]] = {"paddle": [], "native": []}
    argv = ["--batch-size", str(args.batch_size), "--context", str(args.context), "--threads", str(threads)]
    for _ in range(args.profile_rounds):
        for variant, switch in (("paddle", False), ("native", None)):
            llama.NATIVE_FUSED_OPS = switch
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                runs[variant].append(profile_step.main(argv))
    llama.NATIVE_FUSED_OPS = None
    summary: dict[str, Any] = {"batch_size": args.batch_size, "context": args.context, "rounds": args.profile_rounds}
    for variant, reports in runs.items():
        lines: dict[str, list[float]] = {}
        for report in reports:
            for label, value in _norm_swiglu_ms(report["labels_ms"]).items():
                lines.setdefault(label, []).append(value)
        summary[variant] = {
            "step_ms_median": round(statistics.median(r["step_ms_median"] for r in reports), 3),
            "norm_swiglu_ms": {label: round(statistics.median(values), 3) for label, values in lines.items()},
            "norm_swiglu_total_ms": round(statistics.median(
                sum(_norm_swiglu_ms(r["labels_ms"]).values()) for r in reports), 3),
        }
        line = summary[variant]
        print(f"profile_step {variant:<6} step {line['step_ms_median']:.2f} ms  norm+swiglu "
              f"{line['norm_swiglu_total_ms']:.3f} ms  {line['norm_swiglu_ms']}", file=sys.stderr)
    return summary


def step_rounds(args: argparse.Namespace, threads: int) -> list[dict[str, Any]]:
    """Decode-step wall / CPU medians with the fused ops off and on, one model, alternating step by step."""
    from bf16_step import _Sequences
    from model_setup import load_model

    loaded = load_model(argparse.Namespace(model=None, threads=threads, dtype="float32"))
    model, results = loaded.model, []
    for batch_size in (int(value) for value in args.step_batch_sizes.split(",")):
        runs = {name: _Sequences(model, loaded.config, batch_size, args.context, args.step_rounds + 1)
                for name in ("paddle", "native")}
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for step in range(args.step_rounds + 1):
            for name, run in runs.items():
                model.native_fused = name == "native"
                sample = run.decode()
                if step > 0:  # the first decode step of each is a warm-up
                    samples[name].append(sample)
        row: dict[str, Any] = {"batch_size": batch_size, "steps": args.step_rounds}
        for name, values in samples.items():
            row[f"{name}_wall_ms"] = round(statistics.median(v[0] for v in values) * 1e3, 2)
            row[f"{name}_cpu_ms"] = round(statistics.median(v[1] for v in values) * 1e3, 2)
        print(f"decode step batch {batch_size}: {row}", file=sys.stderr)
        results.append(row)
    model.native_fused = True
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = args.threads or envs.FD_NUM_THREADS or envs.available_cores()
    envs.apply_compute_thread_env(threads)
    import paddle

    from worker.kernels import build, fused_ops

    if fused_ops.load() is None:
        raise SystemExit(f"native fused ops unavailable: {build.last_build('fd_fused_ops')}")
    results = []
    with paddle.no_grad():
        for rows in (int(value) for value in args.rows.split(",")):
            for row in bench_rows(rows, args.hidden, args.intermediate, args.repeats):
                print(f"{row['op']:<14} rows {row['rows']:>4}  native {row['native_us']:>9.2f} us  "
                      f"paddle {row['paddle_us']:>9.2f} us  x{row['speedup']}  (native alone "
                      f"{row['native_alone_us']:.2f} us)", file=sys.stderr)
                results.append(row)
    report = {"kernels": "fd_add_rms_norm, fd_silu_and_mul", "threads": threads, "hidden": args.hidden,
              "intermediate": args.intermediate, "repeats": args.repeats, "load_avg_1m": os.getloadavg()[0],
              "paddle_version": paddle.__version__, "results": results}
    if args.step_rounds:
        report["decode_steps"] = step_rounds(args, threads)
    if args.profile_rounds:
        report["profile_step"] = profile_step_rounds(args, threads)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
