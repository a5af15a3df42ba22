"""Tensor-parallel sharding plan: which slice of each checkpoint weight a TP rank holds.

This module owns the Megatron-style split of a dense Llama-family decoder over ``tp_size`` ranks
and the divisibility checks that refuse a model the split cannot serve:

- attention: rank ``r`` holds query heads ``[r*H/N, (r+1)*H/N)`` and KV heads
  ``[r*K/N, (r+1)*K/N)``, i.e. rows of ``q_proj``/``k_proj``/``v_proj`` (and their biases) and the
  matching input columns of ``o_proj``. Contiguous head ranges keep GQA groups whole: query head
  ``h`` reads KV head ``h // (H/K)``, and both ranges scale by the same N.
- MLP: rows ``[r*I/N, (r+1)*I/N)`` of ``gate_proj``/``up_proj`` and those input columns of
  ``down_proj``.
- ``o_proj`` and ``down_proj`` then give partial sums; the model adds them over ranks with an
  all-reduce (rank order, so every rank holds the same bits).
- Embedding, norms and the LM head stay replicated in this increment (every rank computes the
  full logits; splitting the vocabulary and gathering logits is left for later).

Weights are taken in Hugging Face ``[out, in]`` layout; ``shard_getter`` wraps a getter so the
model's ordinary loading code receives the rank's slices.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import paddle

from config.model_config import ModelConfig

logger = logging.getLogger(__name__)

WeightGetter = Callable[[str], np.ndarray]

_LAYER = r"model\.layers\.\d+\."
# name pattern -> (axis of the HF [out, in] array to split, which dimension it follows)
_SPLITS: list[tuple[re.Pattern[str], int, str]] = [
    (re.compile(_LAYER + r"self_attn\.q_proj\.(weight|bias)$"), 0, "q"),
    (re.compile(_LAYER + r"self_attn\.[kv]_proj\.(weight|bias)$"), 0, "kv"),
    (re.compile(_LAYER + r"self_attn\.o_proj\.weight$"), 1, "q"),
    (re.compile(_LAYER + r"mlp\.(gate|up)_proj\.weight$"), 0, "mlp"),
    (re.compile(_LAYER + r"mlp\.down_proj\.weight$"), 1, "mlp"),
]


class TensorParallelError(ValueError):
    """The model cannot be split over the requested number of TP ranks."""


@dataclass(frozen=True)
class ShardPlan:
    """One TP rank's share of a dense decoder."""

    tp_rank: int
    tp_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    intermediate: int  # MLP intermediate columns on this rank

    def rows(self, what: str) -> slice:
        """This rank's slice of the output dimension ``what`` ("q", "kv" or "mlp")."""
        width = {"q": self.num_heads * self.head_dim, "kv": self.num_kv_heads * self.head_dim,
                 "mlp": self.intermediate}[what]
        return slice(self.tp_rank * width, (self.tp_rank + 1) * width)

    def shard(self, name: str, array: np.ndarray) -> np.ndarray:
        """The part of checkpoint weight ``name`` this rank holds (the whole array if replicated)."""
        for pattern, axis, what in _SPLITS:
            if pattern.search(name):
                part = self.rows(what)
                return array[part] if axis == 0 or array.ndim == 1 else array[:, part]
        return array

    def shard_getter(self, get: WeightGetter) -> WeightGetter:
        """``get`` returning this rank's slices (contiguous copies) instead of full weights."""

        def sharded(name: str) -> np.ndarray:
            return np.ascontiguousarray(self.shard(name, get(name)))

        return sharded


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise ``TensorParallelError`` naming the counts when ``config`` does not split over ``tp_size``."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise TensorParallelError(f"tensor parallel size must be a positive int, got {tp_size!r}")
    if tp_size == 1:
        return
    problems = []
    if config.num_attention_heads % tp_size:
        problems.append(f"{config.num_attention_heads} query heads")
    if config.num_key_value_heads % tp_size:
        problems.append(f"{config.num_key_value_heads} KV heads")
    if config.intermediate_size % tp_size:
        problems.append(f"MLP intermediate size {config.intermediate_size}")
    if problems:
        raise TensorParallelError(
            f"tensor parallel size {tp_size} does not divide the model's {' and '.join(problems)} "
            f"({config.num_attention_heads} query heads, {config.num_key_value_heads} KV heads); "
            f"use a size that divides both head counts"
        )
    num_experts = getattr(config, "num_experts", 0) or 0
    if num_experts > 0:
        raise TensorParallelError(
            f"tensor parallelism of MoE models ({num_experts} experts) is not supported yet; use expert parallelism"
        )


def shard_plan(config: ModelConfig, tp_rank: int, tp_size: int) -> ShardPlan:
    """The checked plan of rank ``tp_rank`` of ``tp_size``."""
    check_tensor_parallel(config, tp_size)
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise TensorParallelError(f"tensor parallel rank must be in 0..{tp_size - 1}, got {tp_rank!r}")
    return ShardPlan(
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_heads=config.num_attention_heads // tp_size,
        num_kv_heads=config.num_key_value_heads // tp_size,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size // tp_size,
    )


def shard_weights(weights: dict[str, np.ndarray], plan: ShardPlan) -> dict[str, np.ndarray]:
    """Every checkpoint weight reduced to this rank's slice (views; replicated ones unchanged)."""
    return {name: plan.shard(name, array) for name, array in weights.items()}


def paddle_all_reduce(reduce: Callable[[np.ndarray], np.ndarray]) -> Callable[[paddle.Tensor], paddle.Tensor]:
    """Adapt a numpy all-reduce (``ShmAllReduce.all_reduce``) to the model's tensor -> tensor callable."""

    def all_reduce(tensor: paddle.Tensor) -> paddle.Tensor:
        return paddle.to_tensor(reduce(tensor.numpy()))

    return all_reduce
