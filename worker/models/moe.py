"""Qwen-MoE decoder (Qwen3-MoE with QK norm, Qwen2-MoE with QKV bias and a shared expert) in eager Paddle.

This module owns the sparse mixture-of-experts block and the MoE model around it. The
attention, RMSNorm and RoPE machinery is the Llama family's (``worker.models.llama``),
so the model serves through the same interface: ``forward(input_ids, positions,
kv_caches, meta)``, ``compute_logits``, ``load_weights(dict)``.

A sparse block runs as four steps, so experts can be sharded over processes (expert
parallelism) without touching the maths:

1. ``route``: router softmax -> per-token ``(topk_ids, topk_weights)``;
2. ``dispatch``: group the (token, slot) pairs by expert (host-side, a stable sort);
3. ``compute_experts``: SwiGLU of each *local* expert over its group of tokens, scaled
   by the routing weight; only experts that received tokens run (a loop over experts,
   never over tokens);
4. ``combine``: scatter-add the weighted rows back into token order.

Three ways to run, chosen by the ``ep`` given at construction:

- ``ep=None``: single process, every expert local;
- an ``ExpertParallel``: every rank holds the *same* tokens (attention replicated) and only
  ``ep.local_expert_ids``; it produces a partial output and ``ep.all_reduce_sum`` adds the
  partials of all ranks;
- a ``TokenExchangeExpertParallel`` (DP+EP, ``worker.expert_parallel``): every rank holds
  *different* tokens. ``ep.begin_forward`` runs once per forward; per sparse layer each rank
  routes its own tokens, ``ep.dispatch_tokens`` brings it the (token, routing) rows its local
  experts must process, and ``ep.combine_outputs`` turns their partial outputs back into this
  rank's tokens' summed outputs. Every call is a collective: all ranks must run the same
  number of forwards (the worker's lockstep loop).

The shared expert (Qwen2-MoE) is replicated and applied to the rank's own tokens after the
reduction, so it is counted once.

Float32 only.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Mapping, Protocol, runtime_checkable

import numpy as np
import paddle
import paddle.nn.functional as F

from config.model_config import ModelConfig
from worker.models.llama import LlamaForCausalLM, WeightGetter, LayerWeights, to_weight, weight_getter

logger = logging.getLogger(__name__)

# A routed expert's tensor in a Hugging Face MoE checkpoint: model.layers.L.mlp.experts.E.<proj>.weight
_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.(\d+)\.")


class ExpertParallel(Protocol):
    """The expert-parallel group a MoE model runs in (one instance per rank).

    ``local_expert_ids``: the global ids of the experts this rank holds and computes.
    ``all_reduce_sum``: element-wise sum of ``tensor`` over all ranks, returned on every
    rank. It is called once per sparse layer on every rank, also when none of this
    rank's experts received a token, so the collective never deadlocks.
    """

    local_expert_ids: list[int]

    def all_reduce_sum(self, tensor: paddle.Tensor) -> paddle.Tensor: ...


@runtime_checkable
class TokenExchangeExpertParallel(Protocol):
    """The DP+EP group a MoE model runs in when every rank holds different tokens.

    ``begin_forward(num_tokens)``: called once at the start of every forward on every rank.
    ``dispatch_tokens(hidden, topk_ids, topk_weights)``: the rows ``(hidden [N, H], topk_ids
    [N, k'] int64, topk_weights [N, k'])`` this rank's experts must process, gathered from all
    ranks; ids of experts this rank does not hold are ignored.
    ``combine_outputs(outputs)``: from the local experts' weighted outputs for those N rows
    ([N, H], zero where no local expert ran), the summed expert output of this rank's own
    tokens ([T, H]).
    """

    local_expert_ids: list[int]

    def begin_forward(self, num_tokens: int) -> None: ...

    def dispatch_tokens(
        self, hidden: paddle.Tensor, topk_ids: paddle.Tensor, topk_weights: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]: ...

    def combine_outputs(self, outputs: paddle.Tensor) -> paddle.Tensor: ...


@dataclass
class ExpertWeights:
    """One SwiGLU MLP, pre-transposed for ``x @ W``."""

    gate_up: paddle.Tensor  # [hidden, 2 * intermediate]: gate columns then up columns (F.swiglu's split)
    down: paddle.Tensor  # [intermediate, hidden]


@dataclass
class SparseMoeWeights:
    router: paddle.Tensor  # [hidden, num_experts]
    experts: dict[int, ExpertWeights]  # local experts only, by global expert id
    shared_expert: ExpertWeights | None  # Qwen2-MoE; replicated on every rank
    shared_expert_gate: paddle.Tensor | None  # [hidden, 1]


@dataclass
class DispatchPlan:
    """The step's (token, slot) pairs grouped by expert.

    Pair ``p`` is slot ``p % top_k`` of token ``p // top_k`` (row-major over
    ``topk_ids``). ``order`` lists the pairs sorted by expert (stable, so tokens stay in
    order within a group); expert ``e``'s pairs are ``order[offsets[e]:offsets[e + 1]]``.
    """

    top_k: int
    order: np.ndarray  # [num_tokens * top_k] int64
    offsets: np.ndarray  # [num_experts + 1] int64

    def pairs_of(self, expert_ids: list[int]) -> tuple[list[int], list[int], np.ndarray]:
        """(experts that received tokens, their pair counts, their pairs concatenated) for ``expert_ids``."""
        active, counts, pairs = [], [], []
        for expert in expert_ids:
            start, end = int(self.offsets[expert]), int(self.offsets[expert + 1])
            if end > start:
                active.append(expert)
                counts.append(end - start)
                pairs.append(self.order[start:end])
        flat = np.concatenate(pairs) if pairs else np.zeros(0, dtype=np.int64)
        return active, counts, flat


def route(
    hidden: paddle.Tensor, router: paddle.Tensor, top_k: int, normalize: bool
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(topk_ids [T, k] int64, topk_weights [T, k] float32): softmax over all experts, then top-k.

    ``normalize`` (``norm_topk_prob``) rescales each token's k weights to sum to 1.
    """
    probs = F.softmax(paddle.matmul(hidden, router), axis=-1)
    topk_weights, topk_ids = paddle.topk(probs, top_k, axis=-1)
    if normalize:
        topk_weights = topk_weights / topk_weights.sum(axis=-1, keepdim=True)
    return topk_ids, topk_weights


def dispatch(topk_ids: paddle.Tensor, num_experts: int) -> DispatchPlan:
    """Group the (token, slot) pairs by expert.

    Done on the host: the per-expert group sizes are needed there anyway to slice the
    groups, and the id array is tiny (tokens * top_k).
    """
    ids = topk_ids.numpy().astype(np.int64)
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int64)
    counts = np.bincount(flat, minlength=num_experts)
    offsets = np.zeros(num_experts + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return DispatchPlan(top_k=ids.shape[1], order=order, offsets=offsets)


def compute_experts(
    hidden: paddle.Tensor,
    topk_weights: paddle.Tensor,
    plan: DispatchPlan,
    experts: Mapping[int, ExpertWeights],
) -> tuple[paddle.Tensor, paddle.Tensor] | None:
    """Weighted outputs of the experts in ``experts`` over their tokens.

    Returns (token_rows [P] int64, outputs [P, hidden]) for the P pairs routed to these
    experts, or None when none of them received a token. One gather brings every routed
    row into expert order; each active expert then runs on its contiguous slice.
    """
    active, counts, pairs = plan.pairs_of(sorted(experts))
    if not active:
        return None
    pair_index = paddle.to_tensor(pairs)
    token_rows = paddle.to_tensor(pairs // plan.top_k)
    grouped = paddle.gather(hidden, token_rows)
    slices = paddle.split(grouped, counts, axis=0) if len(counts) > 1 else [grouped]
    outputs = [
        paddle.matmul(F.swiglu(paddle.matmul(rows, experts[expert].gate_up)), experts[expert].down)
        for expert, rows in zip(active, slices)
    ]
    stacked = outputs[0] if len(outputs) == 1 else paddle.concat(outputs, axis=0)
    weights = paddle.gather(topk_weights.reshape([-1]), pair_index).unsqueeze(1)
    return token_rows, stacked * weights


def combine(
    num_tokens: int, hidden_size: int, partial: tuple[paddle.Tensor, paddle.Tensor] | None
) -> paddle.Tensor:
    """[num_tokens, hidden]: each token's expert outputs summed (zeros where no local expert ran)."""
    total = paddle.zeros([num_tokens, hidden_size], dtype="float32")
    if partial is None:
        return total
    token_rows, outputs = partial
    return paddle.index_add(total, token_rows, 0, outputs)


def _swiglu_mlp(hidden: paddle.Tensor, mlp: ExpertWeights) -> paddle.Tensor:
    return paddle.matmul(F.swiglu(paddle.matmul(hidden, mlp.gate_up)), mlp.down)


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE / Qwen2-MoE decoder: Llama-family attention, sparse MoE (or dense) MLP per layer."""

    def __init__(
        self, config: ModelConfig, ep: ExpertParallel | TokenExchangeExpertParallel | None = None
    ) -> None:
        if config.num_experts <= 0:
            raise ValueError(f"{config.architecture!r} config has no experts (num_experts={config.num_experts})")
        super().__init__(config)
        self.ep = ep
        self._exchanges_tokens = isinstance(ep, TokenExchangeExpertParallel)
        # Fixed at construction: load_weights keeps only these experts' weights.
        self.local_expert_ids = _local_expert_ids(config, ep)
        self._local_expert_set = frozenset(self.local_expert_ids)
        self._sparse: list[SparseMoeWeights | None] = []  # per layer; None for a dense-MLP layer

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Take Hugging Face named float32 arrays ([out, in]); keep only the local experts."""
        config = self.config
        get = weight_getter(weights)
        layers, sparse = [], []
        for index in range(config.num_hidden_layers):
            prefix = f"model.layers.{index}."
            is_moe = config.is_moe_layer(index)
            layers.append(self.layer_weights(get, prefix, with_mlp=not is_moe))
            sparse.append(self._sparse_weights(get, prefix + "mlp.") if is_moe else None)
        self._layers = layers
        self._sparse = sparse
        self.load_embeddings(get)
        logger.info(
            "MoE model loaded: %d layers (%d sparse), %d of %d experts local",
            len(layers), sum(block is not None for block in sparse), len(self.local_expert_ids), config.num_experts,
        )

    def needs_weight(self, name: str) -> bool:
        """Every tensor except the experts other expert-parallel ranks hold."""
        match = _EXPERT_WEIGHT.search(name)
        return match is None or int(match.group(1)) in self._local_expert_set

    def _sparse_weights(self, get: WeightGetter, prefix: str) -> SparseMoeWeights:
        router = get(prefix + "gate.weight")
        if router.shape != (self.config.num_experts, self.config.hidden_size):
            raise ValueError(
                f"{prefix}gate.weight has shape {router.shape}, expected "
                f"({self.config.num_experts}, {self.config.hidden_size})"
            )
        shared, shared_gate = None, None
        if self.config.shared_expert_intermediate_size > 0:
            shared = _mlp_weights(get, prefix + "shared_expert.")
            shared_gate = to_weight(get(prefix + "shared_expert_gate.weight").T)
        return SparseMoeWeights(
            router=to_weight(router.T),
            experts={expert: _mlp_weights(get, f"{prefix}experts.{expert}.") for expert in self.local_expert_ids},
            shared_expert=shared,
            shared_expert_gate=shared_gate,
        )

    # ------------------------------------------------------------------ forward

    def begin_forward(self, num_tokens: int) -> None:
        if self._exchanges_tokens:
            self.ep.begin_forward(num_tokens)

    def mlp(self, layer_index: int, hidden: paddle.Tensor, layer: LayerWeights) -> paddle.Tensor:
        block = self._sparse[layer_index]
        return super().mlp(layer_index, hidden, layer) if block is None else self.sparse_moe(hidden, block)

    def sparse_moe(self, hidden: paddle.Tensor, block: SparseMoeWeights) -> paddle.Tensor:
        """The MoE block's output [T, hidden] for normed hidden states [T, hidden]."""
        config = self.config
        topk_ids, topk_weights = route(hidden, block.router, config.num_experts_per_tok, config.norm_topk_prob)
        if self._exchanges_tokens:
            tokens, topk_ids, topk_weights = self.ep.dispatch_tokens(hidden, topk_ids, topk_weights)
        else:
            tokens = hidden
        plan = dispatch(topk_ids, config.num_experts)
        partial = compute_experts(tokens, topk_weights, plan, block.experts)
        output = combine(tokens.shape[0], config.hidden_size, partial)
        if self._exchanges_tokens:
            output = self.ep.combine_outputs(output)
        elif self.ep is not None:
            output = self.ep.all_reduce_sum(output)
        if block.shared_expert is not None:
            gate = F.sigmoid(paddle.matmul(hidden, block.shared_expert_gate))
            output = output + gate * _swiglu_mlp(hidden, block.shared_expert)
        return output


def _local_expert_ids(
    config: ModelConfig, ep: ExpertParallel | TokenExchangeExpertParallel | None
) -> list[int]:
    if ep is None:
        return list(range(config.num_experts))
    ids = [int(expert) for expert in ep.local_expert_ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"local_expert_ids has duplicates: {ids}")
    outside = [expert for expert in ids if not 0 <= expert < config.num_experts]
    if outside:
        raise ValueError(f"local_expert_ids {outside} are outside 0..{config.num_experts - 1}")
    return sorted(ids)


def _mlp_weights(get: WeightGetter, prefix: str) -> ExpertWeights:
    gate_up = np.concatenate([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")])
    return ExpertWeights(gate_up=to_weight(gate_up.T), down=to_weight(get(prefix + "down_proj.weight").T))
