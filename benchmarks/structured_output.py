"""Per-step cost of structured-output token masks (llguidance) for a batch of sequences, on the CPU.

Measures what the engine adds to each decode step when every sequence of the batch is constrained:
``StructuredOutputManager.fill_bitmasks`` (one llguidance call computing the masks of the whole batch)
plus one ``accept`` per sequence (``step_ms``), over whole generations driven by a random sampler under the mask (a
finished sequence is replaced by a fresh one with the same spec, so the batch stays full); on every
other step the masks come from one ``bitmask(seq_id)`` call per sequence instead, for comparison. Also the grammar compile time,
cold and from the cache, and the worker's side: ``apply_logits_processors`` setting the disallowed
logits of the batch to -inf. Prints one JSON report (and writes it to ``--out``).

    python benchmarks/structured_output.py --batch-sizes 8 32 --steps 200
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from config.model_config import default_model_path, load_model_config  # noqa: E402
from config.sampling_params import SamplingParams  # noqa: E402
from config.structured_output import JSON_OBJECT, JSON_SCHEMA, REGEX, StructuredOutputSpec  # noqa: E402
from engine.structured_output import StructuredOutputManager, ll_tokenizer_from  # noqa: E402
from benchmarks.model_setup import write_report  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from worker.logits_processors import RowState, apply_logits_processors  # noqa: E402

logger = logging.getLogger(__name__)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "email", "tags", "address"],
}
SPECS = [StructuredOutputSpec(JSON_SCHEMA, json.dumps(SCHEMA)), StructuredOutputSpec(JSON_OBJECT),
         StructuredOutputSpec(REGEX, r"[A-Z][a-z]{2,8} [0-9]{1,4}(, [A-Z][a-z]{2,8} [0-9]{1,4}){0,5}")]
MAX_TOKENS = 120  # a generation is restarted after this many tokens (json_object may not close by itself)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run_batch(manager: StructuredOutputManager, eos_ids: tuple[int, ...], batch: int, steps: int,
              rng: np.random.Generator) -> dict:
    seq_ids = [f"b{batch}-{i}-0" for i in range(batch)]
    generation = [0] * batch
    lengths = [0] * batch
    for i, seq_id in enumerate(seq_ids):
        manager.add(seq_id, SPECS[i % len(SPECS)])
    for seq_id in seq_ids:
        if not manager.wait_ready(seq_id, 60.0):
            raise RuntimeError(f"{seq_id} did not compile in 60 s")
    out = np.empty((batch, manager.mask_words), dtype=np.int32)
    mask_ms, single_ms, accept_ms, apply_ms = [], [], [], []
    base_logits = rng.standard_normal((batch, manager.vocab_size)).astype(np.float32)
    params = [SamplingParams() for _ in range(batch)]
    for step in range(steps):
        # Even steps: one batched call; odd steps: one ``bitmask(seq_id)`` call per sequence (what the
        # scheduler does today). Only the first computation of a step is timed: llguidance caches a
        # matcher's mask until its next token.
        start = time.perf_counter()
        if step % 2 == 0:
            masks = manager.fill_bitmasks(seq_ids, out)
            mask_ms.append((time.perf_counter() - start) * 1e3)
        else:
            rows = [manager.bitmask(seq_id) for seq_id in seq_ids]
            single_ms.append((time.perf_counter() - start) * 1e3)
            masks = None if any(row is None for row in rows) else np.stack(rows)
        if masks is None:
            raise RuntimeError("a sequence of the batch is not ready")
        # The worker's part: its batched logits processors applying these masks (the copy is not timed).
        logits = base_logits.copy()
        start = time.perf_counter()
        errors = apply_logits_processors(logits, params, [RowState(allowed_token_bitmask=row) for row in masks])
        apply_ms.append((time.perf_counter() - start) * 1e3)
        if errors:
            raise RuntimeError(f"the worker refused the masks: {errors}")
        # The sampler's part (not timed): a random allowed token per row.
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :manager.vocab_size]
        tokens = []
        for row in range(batch):
            allowed = np.flatnonzero(bits[row])
            tokens.append(int(allowed[rng.integers(allowed.size)]))
        start = time.perf_counter()
        for seq_id, token in zip(seq_ids, tokens):
            if not manager.accept(seq_id, token):
                raise RuntimeError(f"{seq_id} refused a token its mask allowed")
        accept_ms.append((time.perf_counter() - start) * 1e3)
        for row, token in enumerate(tokens):
            lengths[row] += 1
            seq_id = seq_ids[row]
            if token in eos_ids or manager.is_finished(seq_id) or lengths[row] >= MAX_TOKENS:
                manager.remove(seq_id)
                generation[row] += 1
                lengths[row] = 0
                seq_ids[row] = f"b{batch}-{row}-{generation[row]}"
                manager.add(seq_ids[row], SPECS[row % len(SPECS)])  # a cache hit: ready almost at once
                manager.wait_ready(seq_ids[row], 60.0)
    for seq_id in seq_ids:
        manager.remove(seq_id)
    step_ms = [m + a for m, a in zip(mask_ms, accept_ms[0::2])]
    return {
        "batch_size": batch,
        "steps": steps,
        "mask_ms_mean": round(statistics.fmean(mask_ms), 3),
        "mask_ms_p50": round(percentile(mask_ms, 50), 3),
        "mask_ms_p99": round(percentile(mask_ms, 99), 3),
        "per_sequence_calls_ms_mean": round(statistics.fmean(single_ms), 3),
        "per_sequence_calls_ms_p50": round(percentile(single_ms, 50), 3),
        "accept_ms_mean": round(statistics.fmean(accept_ms), 3),
        "worker_apply_ms_mean": round(statistics.fmean(apply_ms), 3),
        "worker_apply_ms_p50": round(percentile(apply_ms, 50), 3),
        "step_ms_mean": round(statistics.fmean(step_ms), 3),
        "step_ms_per_sequence": round(statistics.fmean(step_ms) / batch, 4),
        "generations_completed": sum(generation),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model_path())
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mask-threads", type=int, default=1, help="llguidance executor threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON report here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    vocab_size = load_model_config(args.model).vocab_size
    tokenizer = load_tokenizer(args.model)
    start = time.perf_counter()
    ll = ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, vocab_size)
    tokenizer_ms = (time.perf_counter() - start) * 1e3
    manager = StructuredOutputManager(ll, vocab_size, tokenizer_vocab_size=tokenizer.vocab_size,
                                      mask_threads=args.mask_threads)
    try:
        compile_ms = {}
        for kind_index, spec in enumerate(SPECS):
            for attempt in ("cold", "cached"):
                seq_id = f"compile-{kind_index}-{attempt}"
                start = time.perf_counter()
                manager.add(seq_id, spec)
                manager.wait_ready(seq_id, 60.0)
                compile_ms[f"{spec.kind}_{attempt}"] = round((time.perf_counter() - start) * 1e3, 3)
                manager.remove(seq_id)
        rng = np.random.default_rng(args.seed)
        batches = [run_batch(manager, tokenizer.eos_token_ids, size, args.steps, rng) for size in args.batch_sizes]
    finally:
        manager.close()
    report = {
        "benchmark": "structured_output_masks",
        "model": os.path.basename(args.model),
        "vocab_size": vocab_size,
        "mask_threads": args.mask_threads,
        "cpu_count": os.cpu_count(),
        "specs": [spec.kind for spec in SPECS],
        "llguidance_tokenizer_ms": round(tokenizer_ms, 1),
        "compile_ms": compile_ms,
        "batches": batches,
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
