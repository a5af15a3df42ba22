"""Weight loading: GGUF files and Hugging Face safetensors directories -> float32 numpy.

This module owns the translation of checkpoint tensors into Hugging Face canonical
names and layouts (``model.layers.{i}.self_attn.q_proj.weight`` as ``[out, in]``),
dequantised or up-cast to float32. The model turns that dict into its fused,
pre-transposed runtime weights; nothing here imports paddle.
"""
from __future__ import annotations

import json
import logging
import os
import re
import struct
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from config.model_config import ModelConfig, weight_files

logger = logging.getLogger(__name__)

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_GGUF_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.(.+)$")


def load_weights(config: ModelConfig, keep: Callable[[str], bool] | None = None) -> dict[str, np.ndarray]:
    """The checkpoint's weights as contiguous float32 arrays under Hugging Face names.

    ``keep(name)`` False leaves that tensor unread (an expert-parallel rank skips the
    other ranks' experts, which would otherwise be read, widened and dropped); the
    completeness check covers only the kept names.
    """
    wanted = keep or _keep_all
    if config.format == "gguf":
        weights = dict(_iter_gguf(config, wanted))
    elif config.format == "safetensors":
        weights = dict(_iter_safetensors(config, wanted))
    else:
        raise ValueError(f"unknown model format {config.format!r}")
    _check_complete(config, weights, wanted)
    return weights


def _keep_all(name: str) -> bool:
    return True


def expected_weight_names(config: ModelConfig) -> list[str]:
    """The Hugging Face names a complete checkpoint of ``config`` provides."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for layer in range(config.num_hidden_layers):
        names += [f"model.layers.{layer}.{suffix}" for suffix in _layer_weight_suffixes(config, layer)]
    return names


def _layer_weight_suffixes(config: ModelConfig, layer: int) -> list[str]:
    mlp = _moe_weight_suffixes(config) if config.is_moe_layer(layer) else [
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]
    suffixes = [
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        *mlp,
    ]
    if config.attention_bias:
        suffixes += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    if config.qk_norm:
        suffixes += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return suffixes


def _moe_weight_suffixes(config: ModelConfig) -> list[str]:
    """Per-layer names of a sparse MoE block (Qwen3-MoE; plus the Qwen2-MoE shared expert)."""
    suffixes = ["mlp.gate.weight"]
    for expert in range(config.num_experts):
        suffixes += [f"mlp.experts.{expert}.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
    if config.shared_expert_intermediate_size > 0:
        suffixes += [f"mlp.shared_expert.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")]
        suffixes.append("mlp.shared_expert_gate.weight")
    return suffixes


def _check_complete(config: ModelConfig, weights: dict[str, np.ndarray], keep: Callable[[str], bool]) -> None:
    missing = [name for name in expected_weight_names(config) if keep(name) and name not in weights]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {config.path} lacks weights: {shown}")


# --------------------------------------------------------------------------- GGUF


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _GGUF_LAYER_PATTERN.match(name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    return None


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave so rotate-half (Hugging Face) RoPE applies.

    llama.cpp's converter reorders each head's rows from [first half | second half]
    to interleaved pairs for its GPT-J style rope; this is the inverse reorder.
    Works for weights [out, in] and biases [out].
    """
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    tail = weight.shape[1:]
    return weight.reshape(num_heads, head_dim // 2, 2, *tail).swapaxes(1, 2).reshape(out_features, *tail)


def _iter_gguf(config: ModelConfig, keep: Callable[[str], bool]) -> Iterator[tuple[str, np.ndarray]]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(config.path)
    # Only the llama converter permutes Q/K; qwen2/qwen3 use NeoX rope in llama.cpp, already rotate-half.
    permuted = config.architecture == "llama"
    for tensor in tqdm(reader.tensors, desc="Loading weights", unit="tensor"):
        hf_name = _gguf_to_hf_name(tensor.name)
        if hf_name is None:
            logger.warning("ignoring GGUF tensor %s (no Hugging Face counterpart is used)", tensor.name)
            continue
        if not keep(hf_name):
            continue
        # dequantize returns numpy (row-major) order, i.e. GGUF's reversed shape turned back to [out, in].
        array = dequantize(tensor.data, tensor.tensor_type)
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            array = np.array(array, copy=True)  # F32 comes back as a view of the read-only file mapping
        array = np.ascontiguousarray(array, dtype=np.float32)
        if permuted and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            array = np.ascontiguousarray(_unpermute_rope_rows(array, heads))
        yield hf_name, array


# --------------------------------------------------------------------------- safetensors


def _safetensors_header(path: str) -> dict[str, dict]:
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header.pop("__metadata__", None)
    return header


def _bf16_tensor(path: str, entry: dict) -> np.ndarray:
    """numpy has no bfloat16: widen the raw 16-bit patterns into float32's upper half."""
    start, end = entry["data_offsets"]
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        handle.seek(8 + length + start)
        raw = np.frombuffer(handle.read(end - start), dtype=np.uint16)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def _iter_safetensors(config: ModelConfig, keep: Callable[[str], bool]) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    tensors: list[tuple[str, str, dict]] = []
    for file_path in _safetensors_files(config):
        tensors += [(file_path, name, entry) for name, entry in _safetensors_header(file_path).items() if keep(name)]
    handles: dict[str, object] = {}
    for file_path, name, entry in tqdm(tensors, desc="Loading weights", unit="tensor"):
        if entry["dtype"] == "BF16":
            array = _bf16_tensor(file_path, entry)
        else:
            if file_path not in handles:
                handles[file_path] = safe_open(file_path, framework="numpy")
            array = handles[file_path].get_tensor(name)
        yield name, np.ascontiguousarray(array, dtype=np.float32)


def _safetensors_files(config: ModelConfig) -> list[str]:
    index_path = os.path.join(config.path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
        return [os.path.join(config.path, shard) for shard in shards]
    return weight_files(config)
