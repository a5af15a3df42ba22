"""Write a tiny, random, deterministic dense Llama/Qwen2/Qwen3 checkpoint (HF layout) for tensor-parallel tests.

This script owns the dense sibling of ``make_tiny_moe.py``: head counts chosen so the model splits
over 2 and 4 tensor-parallel ranks (8 query heads, 4 KV heads, MLP intermediate 512 by default),
``config.json``, ``model.safetensors`` (float32), ``generation_config.json`` and, unless
``--no-tokenizer``, SmolLM2's tokenizer (shared code with ``make_tiny_moe``). ``qwen2`` adds q/k/v
biases, ``qwen3`` adds q/k norms, so the sharding of both is exercised. Same seed and sizes give
byte-identical files.

    python scripts/make_tiny_dense.py OUT_DIR [--seed 0] [--model-type llama] [--layers 2] [--heads 8] [--kv-heads 4]

Importable: ``make_tiny_dense(out_dir, seed=0, with_tokenizer=True, **sizes) -> str``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from scripts.make_tiny_moe import (  # noqa: E402
    BIAS_STD, EMBED_STD, EOS_TOKEN_ID, VOCAB_SIZE, _smollm2_tokenizer, _write_json, _write_tokenizer, _write_weights,
)

logger = logging.getLogger(__name__)

MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

DEFAULT_SIZES: dict[str, Any] = {
    "model_type": "llama",
    "layers": 2,
    "hidden": 256,
    "heads": 8,
    "kv_heads": 4,
    "head_dim": 32,
    "intermediate": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
}


def make_tiny_dense(out_dir: str, seed: int = 0, with_tokenizer: bool = True, **sizes: Any) -> str:
    """Write the checkpoint into ``out_dir`` (created if needed) and return its path."""
    unknown = sorted(set(sizes) - set(DEFAULT_SIZES))
    if unknown:
        raise TypeError(f"make_tiny_dense got unknown sizes {unknown}; known: {sorted(DEFAULT_SIZES)}")
    config = hf_config({**DEFAULT_SIZES, **sizes})
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": config["bos_token_id"], "eos_token_id": EOS_TOKEN_ID})
    _write_weights(os.path.join(out_dir, "model.safetensors"), random_weights(config, seed))
    if with_tokenizer:
        _write_tokenizer(out_dir, _smollm2_tokenizer())
    logger.info("wrote a tiny %s checkpoint (seed %d) to %s", config["model_type"], seed, out_dir)
    return out_dir


def hf_config(spec: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face config.json body for ``spec`` (sizes as in ``DEFAULT_SIZES``)."""
    model_type = spec["model_type"]
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {sorted(MODEL_TYPES)}, got {model_type!r}")
    if spec["heads"] % spec["kv_heads"]:
        raise ValueError(f"heads ({spec['heads']}) must be a multiple of kv_heads ({spec['kv_heads']})")
    config: dict[str, Any] = {
        "architectures": [MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": float(spec["rope_theta"]),
        "rope_scaling": None,
        "max_position_embeddings": spec["max_position_embeddings"],
        "tie_word_embeddings": bool(spec["tie_word_embeddings"]),
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
        "attention_bias": model_type == "qwen2",
    }
    return config


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight's Hugging Face name and [out, in] shape, in a fixed order."""
    hidden, head_dim, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        shapes.update({
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            attn + "q_proj.weight": (q_out, hidden),
            attn + "k_proj.weight": (kv_out, hidden),
            attn + "v_proj.weight": (kv_out, hidden),
            attn + "o_proj.weight": (hidden, q_out),
            mlp + "gate_proj.weight": (inter, hidden),
            mlp + "up_proj.weight": (inter, hidden),
            mlp + "down_proj.weight": (hidden, inter),
        })
        if config["model_type"] == "qwen3":
            shapes.update({attn + "q_norm.weight": (head_dim,), attn + "k_norm.weight": (head_dim,)})
        if config["attention_bias"]:
            shapes.update({attn + "q_proj.bias": (q_out,), attn + "k_proj.bias": (kv_out,),
                           attn + "v_proj.bias": (kv_out,)})
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def random_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights with the scales of ``make_tiny_moe`` (norms 1 +- noise so q/k norms matter)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith("bias"):
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(BIAS_STD)
        else:
            std = EMBED_STD if name in ("model.embed_tokens.weight", "lm_head.weight") else 1.0 / np.sqrt(shape[-1])
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return weights


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-type", choices=sorted(MODEL_TYPES), default=DEFAULT_SIZES["model_type"])
    for size in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate"):
        parser.add_argument("--" + size.replace("_", "-"), type=int, default=DEFAULT_SIZES[size])
    parser.add_argument("--no-tokenizer", action="store_true", help="config and weights only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    args = parse_args(argv)
    sizes = {size: getattr(args, size) for size in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                    "intermediate")}
    print(make_tiny_dense(args.out_dir, seed=args.seed, with_tokenizer=not args.no_tokenizer,
                          model_type=args.model_type, **sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
