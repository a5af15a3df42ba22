"""Where one decode step's time goes: matmul / attention / sampling / host work and IPC.

This script owns the per-step cost breakdown of the serving worker's decode path. It runs
what the worker runs for a step (flatten a ``StepBatch``, ``build_attention_metadata``, the
registered model's forward over a paged numpy KV cache, ``compute_logits`` on the last
rows, ``Sampler.sample``), plus the engine<->worker message cost (pickle + ZMQ ``ipc://``
send/recv of the ``StepBatch`` and ``StepResult``, in one process, so without the other
process's wake-up latency).

Timing hooks: the ``paddle``, ``F`` and ``incubate_F`` names the model and attention modules
call through are replaced, for the profiled steps only, by proxies that time every function
call (``perf_counter`` around it). Paddle's CPU kernels run synchronously in eager mode, so
a call's wall time is its kernel time; no synchronisation is needed (on a GPU it would be).
Time is *exclusive*: a call nested in another timed call is subtracted from its parent.
Tensor methods and operators (``x.reshape``, ``x + y``, ``scatter_``) are not hooked: their
time stays in the "other ops + Python" row of the part that issued them. Each hook costs
about a microsecond per call (reported as ``hooked_calls_per_step``). The process applies
the worker's malloc tuning (``worker.worker_process.tune_malloc``), as the worker does.

    python benchmarks/profile_step.py [--batch-size 32] [--context 128] [--steps 8] [--out profile.json]
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from model_setup import add_model_arguments, contiguous_cache, load_model, write_report

logger = logging.getLogger(__name__)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32, help="decode sequences per step")
    add_model_arguments(parser, steps=8, steps_help="profiled decode steps (medians are reported)")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.context, args.steps) < 1 or args.warmup < 0:
        parser.error("--batch-size, --context and --steps must be positive, --warmup non-negative")
    return args


class StepClock:
    """Exclusive wall time per label, for one step at a time.

    Hooked calls made inside an ``absorbing`` part (the LM head, sampling) are booked to
    that part, so e.g. the LM head's matmul is reported as "lm_head", not as a model matmul.
    """

    def __init__(self, absorbing: tuple[str, ...] = ("lm_head", "sampling", "host prep", "ipc")) -> None:
        self.exclusive: dict[str, float] = defaultdict(float)
        self.calls = 0
        self._absorbing = absorbing
        self._child_time: list[float] = []
        self._parts: list[str] = []

    def timed(self, label: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._parts and self._parts[-1] in self._absorbing:
                return func(*args, **kwargs)
            self._child_time.append(0.0)
            started = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                children = self._child_time.pop()
                self.exclusive[label] += elapsed - children
                self.calls += 1
                if self._child_time:
                    self._child_time[-1] += elapsed

        return wrapper

    @contextmanager
    def part(self, label: str) -> Iterator[None]:
        """Time a block of the step (host prep, forward, sampling) the same exclusive way."""
        self._child_time.append(0.0)
        self._parts.append(label)
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self._parts.pop()
            self.exclusive[label] += elapsed - self._child_time.pop()
            if self._child_time:
                self._child_time[-1] += elapsed


class TimedNamespace:
    """Stands in for a module (``paddle``, ``F``): its functions come back timed as ``prefix.name``."""

    def __init__(self, module: Any, prefix: str, clock: StepClock) -> None:
        self._module = module
        self._prefix = prefix
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        # Classes (paddle.Tensor in isinstance checks) and submodules pass through untimed.
        if callable(value) and not isinstance(value, type):
            return self._clock.timed(f"{self._prefix}.{name}", value)
        return value


@contextmanager
def hooks_installed(clock: StepClock) -> Iterator[None]:
    """Replace the op namespaces of the model and attention modules by timing proxies, and restore them."""
    import worker.attention as attention_module
    import worker.models.llama as llama_module

    patched: list[tuple[Any, str, Any]] = []
    for module, part in ((llama_module, "model"), (attention_module, "attention")):
        for name in ("paddle", "F", "incubate_F", "native_attention", "fused_ops", "gemv"):
            if hasattr(module, name):
                original = getattr(module, name)
                patched.append((module, name, original))
                setattr(module, name, TimedNamespace(original, f"{part}.{name}", clock))
    for name in ("paged_attention", "rope_paged_attention"):
        if hasattr(llama_module, name):
            original = getattr(llama_module, name)
            patched.append((llama_module, name, original))
            setattr(llama_module, name, clock.timed(f"attention.{name} (other ops + Python)", original))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


def summarise(labels: dict[str, float]) -> dict[str, float]:
    """Fold fine labels into the headline parts (same unit as ``labels``)."""
    parts = {"matmul (layer weights)": 0.0, "lm_head (matmul + column slice)": 0.0, "attention": 0.0,
             "norm/rope/swiglu/split/embedding": 0.0, "sampling": 0.0, "host prep + IPC": 0.0,
             "other ops + Python": 0.0}
    for label, seconds in labels.items():
        if label.startswith("attention."):
            parts["attention"] += seconds
        elif label.endswith((".matmul", ".linear", ".small_linear")):  # small_linear: the native few-row kernel
            parts["matmul (layer weights)"] += seconds
        elif label == "lm_head":
            parts["lm_head (matmul + column slice)"] += seconds
        elif label.startswith("model.") and "(other ops + Python)" not in label:
            parts["norm/rope/swiglu/split/embedding"] += seconds
        elif label == "sampling":
            parts["sampling"] += seconds
        elif label in ("host prep", "ipc"):
            parts["host prep + IPC"] += seconds
        else:
            parts["other ops + Python"] += seconds
    return parts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    loaded = load_model(args)
    import numpy as np
    import paddle
    import zmq

    from config.sampling_params import SamplingParams
    from inter_communicator.messages import ScheduledSeq, StepBatch, StepResult
    from worker.attention import build_attention_metadata
    from worker.sampler import Sampler

    model, config = loaded.model, loaded.config
    sampler = Sampler(seed=args.seed)
    batch_size, block_size = args.batch_size, args.block_size
    total_len = args.context + args.warmup + args.steps + 1
    kv_caches, tables = contiguous_cache(config, batch_size, total_len, block_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=total_len)
    rng = np.random.default_rng(args.seed)
    histories = rng.integers(0, config.vocab_size, size=(batch_size, args.context)).tolist()

    context = zmq.Context()
    endpoint = f"ipc:///tmp/fdserve-profile-{os.getpid()}.sock"
    sender, receiver = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    receiver.bind(endpoint)
    sender.connect(endpoint)

    def run_step(clock: StepClock, step_index: int, prefill: bool) -> None:
        with clock.part("ipc"):
            seqs = []
            for row, history in enumerate(histories):
                new = history if prefill else history[-1:]
                seqs.append(ScheduledSeq(f"req-{row}", list(new), len(history), tables[row], True, greedy, step_index))
            sender.send(pickle.dumps(StepBatch(step_index, seqs), protocol=pickle.HIGHEST_PROTOCOL))
            batch = pickle.loads(receiver.recv())
        with clock.part("host prep"):
            input_ids = np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in batch.seqs])
            meta = build_attention_metadata([len(s.token_ids) for s in batch.seqs], [s.context_len for s in batch.seqs],
                                            [s.block_table for s in batch.seqs], block_size)
            ids_tensor = paddle.to_tensor(input_ids)
        with clock.part("model forward (other ops + Python)"):
            hidden = model(ids_tensor, meta.positions, kv_caches, meta)
        with clock.part("lm_head"):
            logits = model.compute_logits(paddle.index_select(hidden, meta.last_token_indices))
        with clock.part("sampling"):
            tokens = sampler.sample(logits, [s.sampling_params for s in batch.seqs], [s.num_output_tokens for s in batch.seqs])
        with clock.part("ipc"):
            result = StepResult(step_index, {s.request_id: int(t) for s, t in zip(batch.seqs, tokens)})
            sender.send(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
            result = pickle.loads(receiver.recv())
        for row in range(batch_size):
            histories[row].append(result.sampled_token_ids[f"req-{row}"])

    totals: list[float] = []
    per_label: dict[str, list[float]] = defaultdict(list)
    calls = 0
    try:
        with paddle.no_grad():
            run_step(StepClock(), 0, prefill=True)
            for index in range(args.warmup):
                run_step(StepClock(), index + 1, prefill=False)
            for index in range(args.steps):
                clock = StepClock()
                with hooks_installed(clock):
                    started = time.perf_counter()
                    run_step(clock, args.warmup + 1 + index, prefill=False)
                    totals.append(time.perf_counter() - started)
                for label, seconds in clock.exclusive.items():
                    per_label[label].append(seconds)
                calls = clock.calls
    finally:
        sender.close(linger=0)
        receiver.close(linger=0)
        context.term()
        if os.path.exists(endpoint[len("ipc://"):]):
            os.unlink(endpoint[len("ipc://"):])

    medians = {label: statistics.median(values + [0.0] * (args.steps - len(values)))
               for label, values in per_label.items()}
    step_ms = statistics.median(totals) * 1e3
    labels_ms = {label: round(seconds * 1e3, 3) for label, seconds in sorted(medians.items(), key=lambda kv: -kv[1])}
    parts_ms = {name: round(seconds * 1e3, 3) for name, seconds in summarise(medians).items()}
    report = {
        "model": config.path, "paddle_version": paddle.__version__, "threads": loaded.threads,
        "batch_size": batch_size, "context": args.context, "block_size": block_size, "steps": args.steps,
        "step_ms_median": round(step_ms, 3), "step_ms_min": round(min(totals) * 1e3, 3),
        "hooked_calls_per_step": calls, "parts_ms": parts_ms, "labels_ms": labels_ms,
    }
    print_table(report)
    write_report(report, args.out)
    return report


def print_table(report: dict[str, Any]) -> None:
    step = report["step_ms_median"]
    lines = [f"decode step, batch {report['batch_size']}, context {report['context']}: "
             f"median {step:.2f} ms (sum of medians below may differ slightly)",
             f"{'part':<48}{'ms':>9}{'%':>7}"]
    for name, value in report["parts_ms"].items():
        lines.append(f"{name:<48}{value:>9.2f}{100 * value / step:>7.1f}")
    lines.append("detail (exclusive):")
    for name, value in report["labels_ms"].items():
        lines.append(f"  {name:<46}{value:>9.2f}{100 * value / step:>7.1f}")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
