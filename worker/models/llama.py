"""Llama-family decoder (Llama/SmolLM2, Qwen2 with QKV bias, Qwen3 dense with QK norm) in eager Paddle.

This module owns the model's runtime weights (fused and pre-transposed at load) and
its forward pass over a flattened varlen batch. The KV cache is not the model's: the
caller passes per-layer cache tensors and the step's ``AttentionMetadata``.

Float32 only; device-agnostic (weights go to paddle's current device). Eager mode on
purpose: ``to_static`` was measured slower on CPU here. Per-layer Python work is kept
to straight-line tensor calls because at decode batch 1 each op's overhead matters.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.incubate.nn.functional as incubate_F
import paddle.nn.functional as F

from worker.attention import AttentionMetadata, paged_attention
from worker.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class _LayerWeights:
    input_norm: paddle.Tensor  # [hidden]
    qkv: paddle.Tensor  # [hidden, (heads + 2 * kv_heads) * head_dim]
    qkv_bias: paddle.Tensor | None
    q_norm: paddle.Tensor | None  # [head_dim], Qwen3
    k_norm: paddle.Tensor | None
    o_proj: paddle.Tensor  # [heads * head_dim, hidden]
    post_attention_norm: paddle.Tensor  # [hidden]
    gate_up: paddle.Tensor  # [hidden, 2 * intermediate]: gate columns then up columns (F.swiglu's split)
    down: paddle.Tensor  # [intermediate, hidden]


class LlamaForCausalLM(paddle.nn.Layer):
    """Decoder-only transformer: RMSNorm, GQA attention with rotate-half RoPE, SwiGLU MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        self._q_width = self.num_heads * self.head_dim
        self._qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        self._layers: list[_LayerWeights] = []
        self._embed: paddle.Tensor | None = None
        self._final_norm: paddle.Tensor | None = None
        self._lm_head: paddle.Tensor | None = None  # [hidden, vocab]
        self._rope_cos, self._rope_sin = _rope_tables(config)
        self._fused_norm = _fused_rms_norm_available()

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Take Hugging Face named float32 arrays ([out, in] layout) and build the runtime weights."""
        config = self.config

        def get(name: str) -> np.ndarray:
            if name not in weights:
                raise KeyError(f"weight {name!r} is missing from the checkpoint")
            return weights[name]

        def tensor(array: np.ndarray) -> paddle.Tensor:
            return paddle.to_tensor(np.ascontiguousarray(array, dtype=np.float32))

        layers = []
        for index in range(config.num_hidden_layers):
            prefix = f"model.layers.{index}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            qkv = np.concatenate([get(attn + f"{name}_proj.weight") for name in "qkv"])
            gate_up = np.concatenate([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")])
            bias = None
            if config.attention_bias:
                bias = tensor(np.concatenate([get(attn + f"{name}_proj.bias") for name in "qkv"]))
            layers.append(_LayerWeights(
                input_norm=tensor(get(prefix + "input_layernorm.weight")),
                # Transposed once here so every step runs plain x @ W.
                qkv=tensor(qkv.T),
                qkv_bias=bias,
                q_norm=tensor(get(attn + "q_norm.weight")) if config.qk_norm else None,
                k_norm=tensor(get(attn + "k_norm.weight")) if config.qk_norm else None,
                o_proj=tensor(get(attn + "o_proj.weight").T),
                post_attention_norm=tensor(get(prefix + "post_attention_layernorm.weight")),
                gate_up=tensor(gate_up.T),
                down=tensor(get(mlp + "down_proj.weight").T),
            ))
        embed = get("model.embed_tokens.weight")
        if embed.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"embedding shape {embed.shape} does not match config ({config.vocab_size}, {config.hidden_size})"
            )
        lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
        self._layers = layers
        self._embed = tensor(embed)
        self._final_norm = tensor(get("model.norm.weight"))
        self._lm_head = tensor(lm_head.T)

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
        if not self._layers:
            raise RuntimeError("LlamaForCausalLM.forward called before load_weights")
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"expected {len(self._layers)} (k_cache, v_cache) pairs, got {len(kv_caches)}")
        num_tokens = input_ids.shape[0]
        if num_tokens != meta.num_tokens:
            raise ValueError(
                f"input_ids has {num_tokens} tokens but the attention metadata describes {meta.num_tokens}"
            )
        longest = max(meta.context_lens)
        if longest > self.config.max_position_embeddings:
            raise ValueError(
                f"a sequence reaches {longest} tokens, beyond the model's "
                f"{self.config.max_position_embeddings} positions"
            )
        # One RoPE table lookup per step, shared by every layer; q and k heads rotate together.
        rotated_shape = [num_tokens, self.num_heads + self.num_kv_heads, self.head_dim]
        cos = paddle.index_select(self._rope_cos, positions).unsqueeze(1).expand(rotated_shape)
        sin = paddle.index_select(self._rope_sin, positions).unsqueeze(1).expand(rotated_shape)

        hidden = paddle.index_select(self._embed, input_ids)
        residual = None
        for layer, (k_cache, v_cache) in zip(self._layers, kv_caches):
            hidden, residual = self._rms_norm(hidden, layer.input_norm, residual)
            attended = self._attention(hidden, layer, cos, sin, k_cache, v_cache, meta)
            projected = paddle.matmul(attended, layer.o_proj)
            hidden, residual = self._rms_norm(projected, layer.post_attention_norm, residual)
            hidden = paddle.matmul(F.swiglu(paddle.matmul(hidden, layer.gate_up)), layer.down)
        hidden, _ = self._rms_norm(hidden, self._final_norm, residual)
        return hidden

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """float32 logits [N, vocab] for already selected hidden rows [N, hidden]."""
        return paddle.matmul(hidden, self._lm_head)

    def _attention(
        self,
        hidden: paddle.Tensor,
        layer: _LayerWeights,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        k_cache: paddle.Tensor,
        v_cache: paddle.Tensor,
        meta: AttentionMetadata,
    ) -> paddle.Tensor:
        num_tokens = hidden.shape[0]
        qkv = paddle.matmul(hidden, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qk = qkv[:, : self._qk_width].reshape([num_tokens, self.num_heads + self.num_kv_heads, self.head_dim])
        v = qkv[:, self._qk_width:].reshape([num_tokens, self.num_kv_heads, self.head_dim])
        if layer.q_norm is not None:
            q_normed = self._head_rms_norm(qk[:, : self.num_heads], layer.q_norm)
            k_normed = self._head_rms_norm(qk[:, self.num_heads:], layer.k_norm)
            qk = paddle.concat([q_normed, k_normed], axis=1)
        # Rotate-half RoPE: x*cos + [x2, x1]*[-sin, sin]; the sign lives in the sin table.
        qk = qk * cos + paddle.roll(qk, self.head_dim // 2, axis=-1) * sin
        return paged_attention(
            qk[:, : self.num_heads], qk[:, self.num_heads:], v, k_cache, v_cache, meta, self.scale
        )

    def _rms_norm(
        self, x: paddle.Tensor, weight: paddle.Tensor, residual: paddle.Tensor | None
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """(norm(x + residual) * weight, x + residual); the sum becomes the next residual."""
        if self._fused_norm:
            if residual is None:
                # Without a residual the kernel leaves its second output unallocated.
                return incubate_F.fused_rms_norm(x, weight, None, self.eps, 1)[0], x
            return incubate_F.fused_rms_norm(x, weight, None, self.eps, 1, residual=residual)
        summed = x if residual is None else x + residual
        return _plain_rms_norm(summed, weight, self.eps), summed

    def _head_rms_norm(self, x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
        """RMSNorm over head_dim of [T, heads, head_dim] (Qwen3 q_norm / k_norm)."""
        if self._fused_norm:
            return incubate_F.fused_rms_norm(x, weight, None, self.eps, 2)[0]
        return _plain_rms_norm(x, weight, self.eps)


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
