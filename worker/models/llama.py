"""Llama-family decoder (Llama/SmolLM2, Qwen2 with QKV bias, Qwen3 dense with QK norm) in eager Paddle.

This module owns the model's runtime weights (fused and pre-transposed at load) and
its forward pass over a flattened varlen batch. The KV cache is not the model's: the
caller passes per-layer cache tensors and the step's ``AttentionMetadata``.

Float32 by default; ``config.dtype == "bfloat16"`` keeps the linear weights (QKV, o_proj,
gate_up, down, LM head) in bf16 for the native GEMM (``worker.kernels.gemm``), all else float32.
Device-agnostic (weights go to paddle's current device). Eager mode on purpose: ``to_static``
was measured slower on CPU here. Per-layer Python work is kept to straight-line tensor calls
because at decode batch 1 each op's overhead matters.

Weight layout choices made for CPU GEMM speed (measured on the 2-core EPYC, MKL):

- A weight whose row length is a multiple of 4 KiB (gate_up: 3072 floats, the tied LM
  head: 49152 floats) makes MKL's small-M GEMMs 1.5-3x slower (cache-set aliasing of
  the rows). Such weights get zero columns appended (``_PAD_FLOATS``); the extra
  outputs are exact zeros and are dropped (the LM head) or multiply zero rows of the
  next weight (gate_up -> down), so the result is the same float32 computation.
- When the attention scale is a power of two (head_dim 64, 256, ...) and there is no
  q-norm, it is folded into the Q weight columns and bias: scaling by 2^-k is exact in
  float32 and commutes with RoPE, so this removes one op per layer without changing
  any value.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import paddle
import paddle.incubate.nn.functional as incubate_F
import paddle.nn.functional as F

from worker.weight_memory import weight_tensor
from worker.attention import AttentionMetadata, paged_attention, rope_paged_attention, use_native_kernel
from worker.kernels import fused_ops, gemv
from worker.kernels.gemm import PackedBf16, bf16_linear, pack_bf16, require_bf16_gemm
from worker.tensor_parallel import ShardPlan, shard_plan
from config.model_config import ModelConfig

logger = logging.getLogger(__name__)

# Native residual-add + RMSNorm and SwiGLU kernels (worker/kernels/fused_ops.cc): None uses them where they
# build (FD_NATIVE_KERNELS), False keeps Paddle's ops; read when a model is constructed (benchmarks compare both).
NATIVE_FUSED_OPS: bool | None = None
# float32 matmuls of up to this many rows run on the native few-row kernel (worker/kernels/gemv.py), which
# streams the weights with every core; more rows go to paddle.matmul (MKL). Measured (benchmarks/forward.py,
# decode step, native vs MKL): 1 row 13.3 vs 16.9 ms, 2 rows 15.4 vs 17.2, 4 rows equal, 8 rows 25 vs 21.
SMALL_LINEAR_MAX_ROWS = 2

# Zero columns appended to a weight whose row stride is a multiple of 4 KiB (see module doc).
_PAD_FLOATS = 32
_ALIASING_STRIDE_BYTES = 4096
_FLOAT32_BYTES = 4


@dataclass
class LayerWeights:
    """One decoder layer's weights, laid out for the forward pass (the MoE model reuses it)."""

    input_norm: paddle.Tensor  # [hidden]
    qkv: paddle.Tensor  # [hidden, (heads + 2 * kv_heads) * head_dim]
    qkv_bias: paddle.Tensor | None
    q_norm: paddle.Tensor | None  # [head_dim], Qwen3
    k_norm: paddle.Tensor | None
    o_proj: paddle.Tensor  # [heads * head_dim, hidden]
    post_attention_norm: paddle.Tensor  # [hidden]
    # Dense MLP; None in a layer whose MLP lives elsewhere (a MoE layer).
    gate_up: paddle.Tensor | None  # [hidden, 2 * I']: gate columns then up columns (F.swiglu's split), I' >= intermediate
    down: paddle.Tensor | None  # [I', hidden]; rows past intermediate are zero
    # True when the attention scale is already folded into the Q columns of qkv (and qkv_bias).
    q_prescaled: bool = False


class LlamaForCausalLM(paddle.nn.Layer):
    """Decoder-only transformer: RMSNorm, GQA attention with rotate-half RoPE, SwiGLU MLP.

    Tensor parallelism: with ``tp_size`` > 1 this instance is rank ``tp_rank``'s shard
    (``worker.tensor_parallel``): its heads, KV heads and MLP columns only, and ``all_reduce``
    (every rank's tensor summed, the same bits on every rank) adds the partial outputs of
    ``o_proj`` and ``down``. Its KV cache holds ``num_kv_heads`` (this rank's) heads.
    At ``tp_size`` 1 nothing changes: the same weights and ops as without TP.
    """

    def __init__(
        self,
        config: ModelConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: Callable[[paddle.Tensor], paddle.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self._plan: ShardPlan | None = None
        self._all_reduce = None
        if tp_size != 1:
            if all_reduce is None:
                raise ValueError(f"tensor parallel size {tp_size} needs an all_reduce callable")
            self._plan = shard_plan(config, tp_rank, tp_size)
            self._all_reduce = all_reduce
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        self._q_width = self.num_heads * self.head_dim
        self._qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        self._layers: list[LayerWeights] = []
        self._embed: paddle.Tensor | None = None
        self._final_norm: paddle.Tensor | None = None
        self._lm_head: paddle.Tensor | None = None  # [hidden, vocab (+ zero columns, see _pad_columns)]
        self._rope_cos, self._rope_sin = _rope_tables(config)
        self._fused_norm = _fused_rms_norm_available()
        # Native residual-add + RMSNorm and SwiGLU (worker/kernels/fused_ops.cc) when they build; else Paddle's ops.
        self.native_fused = NATIVE_FUSED_OPS is not False and paddle.get_device() == "cpu" and fused_ops.available()
        # The few-row float32 linear (worker/kernels/gemv.py; FD_NATIVE_KERNELS), built here so a cold compile
        # delays start-up, not a step. Its own switch: NATIVE_FUSED_OPS compares the norm and SwiGLU kernels only.
        self._small_linear = paddle.get_device() == "cpu" and gemv.available()
        # --dtype bfloat16: linear weights packed in bf16 for the native GEMM (Bf16Unavailable if it cannot run).
        self._bf16 = require_bf16_gemm() if config.dtype == "bfloat16" else None

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Take Hugging Face named float32 arrays ([out, in] layout) and build the runtime weights."""
        get = weight_getter(weights)
        if self._plan is not None:
            # Layers read this rank's slices; the embedding and LM head stay replicated.
            get = self._plan.shard_getter(get)
        self._layers = [
            self.layer_weights(get, f"model.layers.{index}.", with_mlp=True)
            for index in range(self.config.num_hidden_layers)
        ]
        self.load_embeddings(get)

    def needs_weight(self, name: str) -> bool:
        """Whether ``load_weights`` uses the checkpoint tensor ``name`` (the loader skips the others)."""
        return True

    def layer_weights(self, get: WeightGetter, prefix: str, with_mlp: bool) -> LayerWeights:
        """One decoder layer's attention (and, if ``with_mlp``, dense MLP) weights under ``prefix``."""
        config = self.config
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        qkv = np.concatenate([get(attn + f"{name}_proj.weight") for name in "qkv"])
        bias = None
        if config.attention_bias:
            bias = np.concatenate([get(attn + f"{name}_proj.bias") for name in "qkv"])
        fold_scale = _exact_power_of_two(self.scale) and not config.qk_norm
        if fold_scale:
            qkv, bias = _fold_q_scale(qkv, bias, self._q_width, self.scale)
        gate_up, down = None, None
        if with_mlp:
            gate_up, down = _padded_mlp(get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight"),
                                        get(mlp + "down_proj.weight"))
        return LayerWeights(
            input_norm=to_weight(get(prefix + "input_layernorm.weight")),
            # Transposed once here so every step runs plain x @ W.
            qkv=self.linear_weight(qkv.T),
            qkv_bias=to_weight(bias) if bias is not None else None,
            q_norm=to_weight(get(attn + "q_norm.weight")) if config.qk_norm else None,
            k_norm=to_weight(get(attn + "k_norm.weight")) if config.qk_norm else None,
            o_proj=self.linear_weight(get(attn + "o_proj.weight").T),
            post_attention_norm=to_weight(get(prefix + "post_attention_layernorm.weight")),
            gate_up=self.linear_weight(gate_up) if gate_up is not None else None,
            down=self.linear_weight(down) if down is not None else None,
            q_prescaled=fold_scale,
        )

    def load_embeddings(self, get: WeightGetter) -> None:
        """Token embedding, final norm and LM head (the embedding itself when tied)."""
        config = self.config
        embed = get("model.embed_tokens.weight")
        if embed.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"embedding shape {embed.shape} does not match config ({config.vocab_size}, {config.hidden_size})"
            )
        lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
        self._embed = to_weight(embed)
        self._final_norm = to_weight(get("model.norm.weight"))
        # The bf16 kernel has no row-aliasing slowdown: its head keeps exactly vocab columns.
        self._lm_head = pack_bf16(lm_head.T) if self._bf16 is not None else to_weight(_pad_columns(lm_head.T))

    def linear_weight(self, weight: np.ndarray) -> paddle.Tensor | PackedBf16:
        """An [in, out] linear weight in the model's dtype: a float32 tensor, or bf16 packed for ``linear``."""
        return pack_bf16(weight) if self._bf16 is not None else to_weight(weight)

    def linear(self, x: paddle.Tensor, weight: paddle.Tensor | PackedBf16) -> paddle.Tensor:
        """x [T, in] float32 @ weight -> [T, out] float32 (bf16 weights: x rounded to bf16, float32 accumulation)."""
        if isinstance(weight, PackedBf16):
            return bf16_linear(self._bf16, x, weight)
        if self._small_linear:
            out = gemv.small_linear(x, weight, SMALL_LINEAR_MAX_ROWS)
            if out is not None:
                return out
        return paddle.matmul(x, weight)

    # ------------------------------------------------------------------ forward

    @paddle.no_grad()
    def forward(
        self,
        input_ids: paddle.Tensor,
        positions: paddle.Tensor,
        kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]],
        meta: AttentionMetadata,
    ) -> paddle.Tensor:
        """Final-norm hidden states [T, hidden] of a flattened varlen batch of T new tokens."""
        self._check_step(input_ids, kv_caches, meta)
        num_tokens = input_ids.shape[0]
        self.begin_forward(num_tokens)
        if self._fused_attention():
            # The native op rotates, writes the cache and attends in one call per layer, reading the tables itself.
            cos = sin = None
        else:
            # One RoPE table lookup per step, shared by every layer; q and k heads rotate together.
            rotated_shape = [num_tokens, self.num_heads + self.num_kv_heads, self.head_dim]
            cos = paddle.index_select(self._rope_cos, positions).unsqueeze(1).expand(rotated_shape)
            sin = paddle.index_select(self._rope_sin, positions).unsqueeze(1).expand(rotated_shape)

        hidden = paddle.index_select(self._embed, input_ids)
        residual = None
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self._layers, kv_caches)):
            hidden, residual = self._rms_norm(hidden, layer.input_norm, residual)
            attended = self._attention(hidden, layer, positions, cos, sin, k_cache, v_cache, meta)
            projected = self.linear(attended, layer.o_proj)
            if self._all_reduce is not None:
                projected = self._all_reduce(projected)
            hidden, residual = self._rms_norm(projected, layer.post_attention_norm, residual)
            hidden = self.mlp(index, hidden, layer)
            if self._all_reduce is not None:
                hidden = self._all_reduce(hidden)
        hidden, _ = self._rms_norm(hidden, self._final_norm, residual)
        return hidden

    def begin_forward(self, num_tokens: int) -> None:
        """Hook run once per forward before the first layer (expert parallelism announces its batch here)."""

    def mlp(self, layer_index: int, hidden: paddle.Tensor, layer: LayerWeights) -> paddle.Tensor:
        """The MLP of layer ``layer_index`` on normed hidden states [T, hidden]."""
        return self.linear(self._swiglu(self.linear(hidden, layer.gate_up)), layer.down)

    def _swiglu(self, gate_up: paddle.Tensor) -> paddle.Tensor:
        """silu(gate) * up over the gate | up halves of [T, 2 * I']."""
        if self.native_fused:
            return fused_ops.silu_and_mul(gate_up)
        return F.swiglu(gate_up)

    def _check_step(
        self, input_ids: paddle.Tensor, kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]], meta: AttentionMetadata
    ) -> None:
        if not self._layers:
            raise RuntimeError(f"{type(self).__name__}.forward called before load_weights")
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"expected {len(self._layers)} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        if input_ids.shape[0] != meta.num_tokens:
            raise ValueError(
                f"input_ids has {input_ids.shape[0]} tokens but the attention metadata describes {meta.num_tokens}"
            )
        longest = max(meta.context_lens)
        if longest > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence reaches {longest} tokens, beyond the model's "
                f"{self.config.max_position_embeddings} positions"
            )

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """float32 logits [N, vocab] for already selected hidden rows [N, hidden]."""
        logits = self.linear(hidden, self._lm_head)
        vocab = self.config.vocab_size
        # The padded head's extra columns are zeros, not tokens: never let them reach the sampler.
        return logits if logits.shape[1] == vocab else logits[:, :vocab]

    def _fused_attention(self) -> bool:
        """Whether this step runs RoPE + cache write + attention as one native op per layer (fd_rope_paged_attention).

        Not for models with per-head q/k norms (the norm sits between the projection and RoPE).
        """
        return not self.config.qk_norm and use_native_kernel()

    def _attention(
        self,
        hidden: paddle.Tensor,
        layer: LayerWeights,
        positions: paddle.Tensor,
        cos: paddle.Tensor | None,
        sin: paddle.Tensor | None,
        k_cache: paddle.Tensor,
        v_cache: paddle.Tensor,
        meta: AttentionMetadata,
    ) -> paddle.Tensor:
        """Attention output [T, heads * D] of one layer; ``cos``/``sin`` None: the fused native op."""
        num_tokens = hidden.shape[0]
        num_rotated = self.num_heads + self.num_kv_heads
        qkv = self.linear(hidden, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        scale = 1.0 if layer.q_prescaled else self.scale
        if cos is None:
            return rope_paged_attention(qkv, self._rope_cos, self._rope_sin, positions, k_cache, v_cache, meta,
                                        self.num_heads, scale)
        # split (not slicing) so every later op gets contiguous inputs: Paddle materialises strided
        # views with a generic copy kernel that was measured ~10x slower than split.
        qk, v = paddle.split(qkv, [self._qk_width, qkv.shape[1] - self._qk_width], axis=1)
        qk = qk.reshape([num_tokens, num_rotated, self.head_dim])
        v = v.reshape([num_tokens, self.num_kv_heads, self.head_dim])
        if layer.q_norm is not None:
            q_part, k_part = paddle.split(qk, [self.num_heads, self.num_kv_heads], axis=1)
            qk = paddle.concat(
                [self._head_rms_norm(q_part, layer.q_norm), self._head_rms_norm(k_part, layer.k_norm)], axis=1
            )
        # Rotate-half RoPE: x*cos + [x2, x1]*[-sin, sin]; the sign lives in the sin table. The half
        # swap is a row gather over half-head rows (bit-identical to paddle.roll, ~20x faster).
        half_rows = num_tokens * num_rotated
        swap = meta.derived(("rope_half_swap", half_rows), lambda: _half_swap_rows(half_rows))
        swapped = paddle.gather(qk.reshape([-1, self.head_dim // 2]), swap).reshape(qk.shape)
        qk = qk * cos + swapped * sin
        q, k = paddle.split(qk, [self.num_heads, self.num_kv_heads], axis=1)
        return paged_attention(q, k, v, k_cache, v_cache, meta, scale)

    def _rms_norm(
        self, x: paddle.Tensor, weight: paddle.Tensor, residual: paddle.Tensor | None
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(norm(x + residual) * weight, x + residual); the sum becomes the next residual."""
        if self.native_fused:
            if residual is None:
                return fused_ops.rms_norm(x, weight, self.eps), x
            return fused_ops.fused_add_rms_norm(x, residual, weight, self.eps)
        if self._fused_norm:
            if residual is None:
                # Without a residual the kernel leaves its second output unallocated.
                return incubate_F.fused_rms_norm(x, weight, None, self.eps, 1)[0], x
            return incubate_F.fused_rms_norm(x, weight, None, self.eps, 1, residual=residual)
        summed = x if residual is None else x + residual
        return _plain_rms_norm(summed, weight, self.eps), summed

    def _head_rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        """RMSNorm over head_dim of [T, heads, head_dim] (Qwen3 q_norm / k_norm)."""
        if self.native_fused:
            return fused_ops.rms_norm(x, weight, self.eps)
        if self._fused_norm:
            return incubate_F.fused_rms_norm(x, weight, None, self.eps, 2)[0]
        return _plain_rms_norm(x, weight, self.eps)


WeightGetter = Callable[[str], np.ndarray]


def weight_getter(weights: dict[str, np.ndarray]) -> WeightGetter:
    """``get(name)``: the named checkpoint array, or a KeyError naming the missing weight."""

    def get(name: str) -> np.ndarray:
        if name not in weights:
            raise KeyError(f"weight {name!r} is missing from the checkpoint")
        return weights[name]

    return get


def to_weight(array: np.ndarray) -> paddle.Tensor:
    """A contiguous float32 paddle tensor copy of ``array``, in 2 MiB-page memory (worker.weight_memory)."""
    return weight_tensor(np.asarray(array, dtype=np.float32))


def _half_swap_rows(num_heads_total: int) -> paddle.Tensor:
    """Row order that swaps the two halves of every head in a [heads, D] tensor viewed as [2 * heads, D / 2]."""
    return paddle.to_tensor(np.arange(2 * num_heads_total, dtype=np.int64) ^ 1)


def _exact_power_of_two(value: float) -> bool:
    mantissa, _exponent = np.frexp(value)
    return bool(mantissa == 0.5)


def _fold_q_scale(
    qkv: np.ndarray, bias: np.ndarray | None, q_rows: int, scale: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """qkv ([out, in]) and bias with the first ``q_rows`` outputs multiplied by ``scale`` (a power of two)."""
    qkv = qkv.astype(np.float32, copy=True)
    qkv[:q_rows] *= np.float32(scale)
    if bias is not None:
        bias = bias.astype(np.float32, copy=True)
        bias[:q_rows] *= np.float32(scale)
    return qkv, bias


def _aliasing(columns: int) -> bool:
    return (columns * _FLOAT32_BYTES) % _ALIASING_STRIDE_BYTES == 0


def _pad_columns(weight: np.ndarray) -> np.ndarray:
    """[in, out] weight, with ``_PAD_FLOATS`` zero columns appended if its rows alias (module doc)."""
    if not _aliasing(weight.shape[1]):
        return weight
    return np.pad(weight, ((0, 0), (0, _PAD_FLOATS)))


def _padded_mlp(gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gate_up [hidden, 2 * I'], down [I', hidden]) from HF [out, in] weights.

    If 2 * intermediate floats alias, each half gets ``_PAD_FLOATS / 2`` zero columns so
    F.swiglu's split stays gate | up; the padded outputs are silu(0) * 0 = 0 and meet
    zero rows of ``down``.
    """
    intermediate = gate.shape[0]
    pad = _PAD_FLOATS // 2 if _aliasing(2 * intermediate) else 0
    gate_t = np.pad(gate.T, ((0, 0), (0, pad)))
    up_t = np.pad(up.T, ((0, 0), (0, pad)))
    down_t = np.pad(down.T, ((0, pad), (0, 0)))
    return np.concatenate([gate_t, up_t], axis=1), down_t


def _plain_rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    return x * paddle.rsqrt(paddle.mean(x * x, axis=-1, keepdim=True) + eps) * weight


def _fused_rms_norm_available() -> bool:
    """Whether this paddle build has a fused_rms_norm kernel for the current device."""
    try:
        probe = paddle.ones([1, 4], dtype="float32")
        incubate_F.fused_rms_norm(probe, paddle.ones([4], dtype="float32"), None, 1e-6, 1)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        logger.info("fused_rms_norm unavailable (%s); using the composed RMSNorm", exc)
        return False
    return True


def _rope_tables(config: ModelConfig) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos and sign-folded sin tables [max_positions, head_dim] for rotate-half RoPE.

    Angles are formed in float32 as Hugging Face does (so positions agree bit for bit
    with the reference), then cos/sin are evaluated in float64 and rounded once.
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(config.head_dim)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    positions = np.arange(config.max_position_embeddings, dtype=np.float32)
    angles = np.outer(positions, inv_freq).astype(np.float32).astype(np.float64)
    cos = np.cos(angles).astype(np.float32)
    sin = np.sin(angles).astype(np.float32)
    cos_table = np.concatenate([cos, cos], axis=1)
    sin_table = np.concatenate([-sin, sin], axis=1)
    return paddle.to_tensor(cos_table), paddle.to_tensor(sin_table)
