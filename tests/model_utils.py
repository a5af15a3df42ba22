"""Driving a model directly (no server) through a fixed schedule of mixed prefill/decode steps.

Shared by the dense and MoE model tests, which check the logits of every computed position against an
independent dense numpy implementation.
"""
from __future__ import annotations

import numpy as np
import paddle

from worker.attention import build_attention_metadata

# Two sequences, "a" (16 tokens) and "b" (12), as (name, new tokens) per step, decodes first. Covers two
# prefills in one step, a prefix chunk next to a decode, and a decode batch over sequences of unequal lengths.
TWO_SEQUENCE_SCHEDULE = [[("a", 7), ("b", 9)], [("b", 1), ("a", 6)], [("b", 1), ("a", 1)], [("a", 1), ("b", 1)],
                         [("a", 1)]]


def run_schedule(model, kv_caches, seqs: dict[str, list[int]], tables: dict[str, list[int]],
                 schedule: list[list[tuple[str, int]]], block_size: int) -> dict[str, np.ndarray]:
    """Logits [computed positions, vocab] per sequence after running ``schedule`` over its token ids."""
    done = {name: 0 for name in seqs}
    produced: dict[str, list[np.ndarray]] = {name: [] for name in seqs}
    for step in schedule:
        meta = build_attention_metadata(
            [count for _, count in step], [done[name] + count for name, count in step],
            [tables[name] for name, _ in step], block_size,
        )
        ids = [token for name, count in step for token in seqs[name][done[name]: done[name] + count]]
        hidden = model(paddle.to_tensor(ids, dtype="int64"), meta.positions, kv_caches, meta)
        logits = model.compute_logits(hidden).numpy()
        start = 0
        for name, count in step:
            produced[name].append(logits[start: start + count])
            start += count
            done[name] += count
    return {name: np.concatenate(parts) for name, parts in produced.items()}
