"""Write a tiny, random, deterministic Qwen-MoE checkpoint (HF layout) that reuses SmolLM2's tokenizer.

This script owns the test/dev MoE checkpoint: ``config.json`` (Qwen3-MoE, or Qwen2-MoE
with a shared expert), ``model.safetensors`` (float32), ``generation_config.json`` and
the SmolLM2 tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with the chat
template) rebuilt from the default GGUF. The same seed and sizes give byte-identical
files. Outputs of the random model are gibberish but not degenerate.

    python scripts/make_tiny_moe.py OUT_DIR [--seed 0] [--layers 4] [--hidden 256] [--experts 8] [--top-k 2]

Importable: ``make_tiny_moe(out_dir, seed=0, **sizes) -> str``.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from typing import Any

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    # Run as `python scripts/make_tiny_moe.py` from a checkout that is not pip-installed.
    sys.path.insert(0, REPO_ROOT)

from engine.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from config.model_config import default_model_path  # noqa: E402

logger = logging.getLogger(__name__)

VOCAB_SIZE = 49152  # SmolLM2's vocabulary, so its tokenizer can be reused
EOS_TOKEN_ID = 2
MODEL_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# Initial scales. Projections are N(0, 1/fan_in) so every sublayer's output is O(1), like its
# normed input: attention scores are O(1) (neither uniform nor one-hot), router logits spread
# tokens over experts, and the residual stream is carried by the layers, so the next token
# depends on the context. (A flat 0.02 made attention near-uniform over the shared system
# prompt: every prompt decoded to one repeated token.)
# Embeddings stay small (0.02): with tied weights a large embedding makes each token's
# own row dominate the logits and greedy decoding repeats the input token (measured).
EMBED_STD = 0.02
BIAS_STD = 0.02
_EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")

DEFAULT_SIZES: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "layers": 4,
    "hidden": 256,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
    "experts": 8,
    "top_k": 2,
    "moe_intermediate": 128,
    "intermediate": 512,  # dense-MLP layers (decoder_sparse_step > 1 or mlp_only_layers)
    "shared_expert_intermediate": 0,  # > 0 only for qwen2_moe
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "norm_topk_prob": True,
    "tie_word_embeddings": True,  # halves the file: the embedding is most of a tiny model
    "max_position_embeddings": 2048,
    "rope_theta": 1000000.0,
}


def make_tiny_moe(out_dir: str, seed: int = 0, **sizes: Any) -> str:
    """Write the checkpoint into ``out_dir`` (created if needed) and return its path.

    ``sizes`` override ``DEFAULT_SIZES`` (unknown names raise TypeError).
    """
    unknown = sorted(set(sizes) - set(DEFAULT_SIZES))
    if unknown:
        raise TypeError(f"make_tiny_moe got unknown sizes {unknown}; known: {sorted(DEFAULT_SIZES)}")
    spec = {**DEFAULT_SIZES, **sizes}
    config = hf_config(spec)
    os.makedirs(out_dir, exist_ok=True)
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": config["bos_token_id"], "eos_token_id": EOS_TOKEN_ID})
    _write_weights(os.path.join(out_dir, "model.safetensors"), random_weights(config, seed))
    _write_tokenizer(out_dir, _smollm2_tokenizer())
    logger.info("wrote a tiny %s checkpoint (seed %d) to %s", config["model_type"], seed, out_dir)
    return out_dir


def hf_config(spec: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face config.json body for ``spec`` (sizes as in ``DEFAULT_SIZES``)."""
    model_type = spec["model_type"]
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {sorted(MODEL_TYPES)}, got {model_type!r}")
    if not 1 <= spec["top_k"] <= spec["experts"]:
        raise ValueError(f"top_k must be in 1..experts ({spec['experts']}), got {spec['top_k']}")
    if spec["shared_expert_intermediate"] and model_type != "qwen2_moe":
        raise ValueError("a shared expert is a Qwen2-MoE feature: use model_type='qwen2_moe'")
    config: dict[str, Any] = {
        "architectures": [MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"],
        "moe_intermediate_size": spec["moe_intermediate"],
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"],
        "num_experts": spec["experts"],
        "num_experts_per_tok": spec["top_k"],
        "norm_topk_prob": bool(spec["norm_topk_prob"]),
        "decoder_sparse_step": spec["decoder_sparse_step"],
        "mlp_only_layers": [int(layer) for layer in spec["mlp_only_layers"]],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": float(spec["rope_theta"]),
        "rope_scaling": None,
        "max_position_embeddings": spec["max_position_embeddings"],
        "tie_word_embeddings": bool(spec["tie_word_embeddings"]),
        "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID,
        "torch_dtype": "float32",
        "use_sliding_window": False,
        "output_router_logits": False,
    }
    if model_type == "qwen3_moe":
        config["attention_bias"] = False
    else:
        # Qwen2-MoE has q/k/v biases unconditionally (its config has no switch for them).
        config["shared_expert_intermediate_size"] = spec["shared_expert_intermediate"]
    return config


def is_moe_layer(config: dict[str, Any], layer: int) -> bool:
    return (
        config["num_experts"] > 0
        and layer not in config["mlp_only_layers"]
        and (layer + 1) % config["decoder_sparse_step"] == 0
    )


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight's Hugging Face name and [out, in] shape, in a fixed order."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        attn = prefix + "self_attn."
        shapes.update({
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            attn + "q_proj.weight": (q_out, hidden),
            attn + "k_proj.weight": (kv_out, hidden),
            attn + "v_proj.weight": (kv_out, hidden),
            attn + "o_proj.weight": (hidden, q_out),
        })
        if config["model_type"] == "qwen3_moe":
            shapes.update({attn + "q_norm.weight": (head_dim,), attn + "k_norm.weight": (head_dim,)})
        else:
            shapes.update({attn + "q_proj.bias": (q_out,), attn + "k_proj.bias": (kv_out,),
                           attn + "v_proj.bias": (kv_out,)})
        mlp = prefix + "mlp."
        if not is_moe_layer(config, layer):
            shapes.update(_swiglu_shapes(mlp, hidden, config["intermediate_size"]))
            continue
        shapes[mlp + "gate.weight"] = (config["num_experts"], hidden)
        for expert in range(config["num_experts"]):
            shapes.update(_swiglu_shapes(f"{mlp}experts.{expert}.", hidden, config["moe_intermediate_size"]))
        shared = config.get("shared_expert_intermediate_size", 0)
        if shared:
            shapes.update(_swiglu_shapes(mlp + "shared_expert.", hidden, shared))
            shapes[mlp + "shared_expert_gate.weight"] = (1, hidden)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _swiglu_shapes(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (intermediate, hidden),
        prefix + "up_proj.weight": (intermediate, hidden),
        prefix + "down_proj.weight": (hidden, intermediate),
    }


def random_weights(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights: norms are 1, embeddings N(0, EMBED_STD^2), projections N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shape, dtype=np.float32)
        elif name.endswith("bias"):
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(BIAS_STD)
        else:
            std = EMBED_STD if name in _EMBEDDING_NAMES else 1.0 / np.sqrt(shape[-1])
            weights[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return weights


def _write_weights(path: str, weights: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(weights, path, metadata={"format": "pt"})


def _write_json(path: str, body: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(body, handle, indent=2, sort_keys=True, ensure_ascii=False)
        handle.write("\n")


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer() -> Tokenizer:
    # Building it from the GGUF vocabulary takes ~2 s; tests generate several checkpoints.
    return load_tokenizer(default_model_path())


def _write_tokenizer(out_dir: str, tokenizer: Tokenizer) -> None:
    tokenizer.backend.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(token_id): {
            "content": token.content, "lstrip": token.lstrip, "rstrip": token.rstrip,
            "normalized": token.normalized, "single_word": token.single_word, "special": token.special,
        }
        for token_id, token in sorted(tokenizer.backend.get_added_tokens_decoder().items())
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "GPT2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.eos_token,
        "chat_template": tokenizer.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
    })


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-type", choices=sorted(MODEL_TYPES), default=DEFAULT_SIZES["model_type"])
    for flag in ("layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "top_k", "moe_intermediate",
                 "intermediate", "shared_expert_intermediate", "decoder_sparse_step", "max_position_embeddings"):
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=DEFAULT_SIZES[flag])
    parser.add_argument("--mlp-only-layers", default="", help="comma-separated layer indices with a dense MLP")
    parser.add_argument("--no-norm-topk-prob", dest="norm_topk_prob", action="store_false",
                        help="keep the raw softmax weights of the top-k experts")
    parser.add_argument("--untie-word-embeddings", dest="tie_word_embeddings", action="store_false",
                        help="write a separate lm_head.weight")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    sizes = {name: value for name, value in vars(args).items() if name in DEFAULT_SIZES}
    sizes["mlp_only_layers"] = tuple(int(item) for item in args.mlp_only_layers.split(",") if item.strip())
    path = make_tiny_moe(args.out_dir, seed=args.seed, **sizes)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
