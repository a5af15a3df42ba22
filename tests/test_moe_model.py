"""The Qwen-MoE model family and the tiny deterministic MoE checkpoint generator.

Checkpoints come from ``scripts/make_tiny_moe.py`` (tiny sizes, real SmolLM2 tokenizer).
The model runs through the same paged-KV interface the worker uses and is checked
against an independent float64 numpy implementation of the MoE maths (loops over
tokens and experts), against itself without a cache, and split over two in-process
expert-parallel "ranks".
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading

import envs

envs.apply_compute_thread_env(2)

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from engine.tokenizer import load_tokenizer  # noqa: E402
from worker import attention  # noqa: E402
from cache_manager.kv_layout import device_cache_shape  # noqa: E402
from worker.attention import build_attention_metadata, kv_cache_views  # noqa: E402
from worker.loader import load_weights  # noqa: E402
from config.model_config import ModelConfig, default_model_path, load_model_config  # noqa: E402
from worker.models import get_model_class  # noqa: E402
from tests.model_utils import TWO_SEQUENCE_SCHEDULE, run_schedule  # noqa: E402
from worker.models.moe import MoEForCausalLM  # noqa: E402
from harness.reference import load_reference  # noqa: E402

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "make_tiny_moe.py")
BLOCK_SIZE = 16
NUM_BLOCKS = 64
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json")
# Small enough for fast tests; the 49152-row embedding (SmolLM2's vocabulary) dominates.
TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": 4, "top_k": 2,
        "moe_intermediate": 32, "intermediate": 64, "max_position_embeddings": 512}


def _load_script():
    spec = importlib.util.spec_from_file_location("make_tiny_moe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tiny_moe = _load_script().make_tiny_moe


def load_rank_model(path: str, ep: "RankEP", weights: dict[str, np.ndarray]) -> MoEForCausalLM:
    """The registered model class for ``path``, holding only ``ep``'s experts."""
    config = load_model_config(path)
    model = get_model_class(config.architecture)(config, ep=ep)
    model.load_weights(weights)
    return model


def new_kv_caches(config: ModelConfig) -> list:
    return kv_cache_views(np.zeros(device_cache_shape(config, NUM_BLOCKS, BLOCK_SIZE), dtype=np.float32))


def forward_logits(model, kv_caches, steps_input: list[tuple[list[int], int, list[int]]]) -> np.ndarray:
    """One step: (new token ids, context length after the step, block table) per sequence, decodes first."""
    meta = build_attention_metadata(
        [len(ids) for ids, _, _ in steps_input], [context for _, context, _ in steps_input],
        [table for _, _, table in steps_input], BLOCK_SIZE,
    )
    ids = [token for new_ids, _, _ in steps_input for token in new_ids]
    hidden = model(paddle.to_tensor(ids, dtype="int64"), meta.positions, kv_caches, meta)
    return model.compute_logits(hidden).numpy()


def greedy_paged(model, config, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Prefill all prompts in one step, then batched decode steps, on scattered blocks of one cache."""
    kv_caches = new_kv_caches(config)
    pool = np.random.default_rng(1).permutation(NUM_BLOCKS).tolist()
    share = NUM_BLOCKS // len(prompts)
    tables = [pool[i * share:(i + 1) * share] for i in range(len(prompts))]
    logits = forward_logits(model, kv_caches, [(p, len(p), t) for p, t in zip(prompts, tables)])
    ends = np.cumsum([len(p) for p in prompts]) - 1
    outputs = [[int(logits[end].argmax())] for end in ends]
    for _ in range(new_tokens - 1):
        step = [([out[-1]], len(p) + len(out), t) for p, out, t in zip(prompts, outputs, tables)]
        logits = forward_logits(model, kv_caches, step)
        for out, row in zip(outputs, logits):
            out.append(int(row.argmax()))
    return outputs


def greedy_recompute(model, config, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding that recomputes the whole sequence every step in a fresh cache."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        logits = forward_logits(model, new_kv_caches(config), [(tokens, len(tokens), list(range(NUM_BLOCKS)))])
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def reference_prompts() -> list[list[int]]:
    return [entry["prompt_ids"] for entry in load_reference()]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_moe(str(tmp_path_factory.mktemp("tiny_moe")), seed=0, **TINY)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    config = load_model_config(tiny_dir)
    weights = load_weights(config)
    model = get_model_class(config.architecture)(config)
    model.load_weights(weights)
    return config, weights, model


# --------------------------------------------------------------------------- generator


@pytest.mark.integration
def test_same_seed_gives_identical_bytes_and_another_seed_other_weights(tmp_path) -> None:
    first = make_tiny_moe(str(tmp_path / "a"), seed=3, **TINY)
    again = make_tiny_moe(str(tmp_path / "b"), seed=3, **TINY)
    other = make_tiny_moe(str(tmp_path / "c"), seed=4, **TINY)
    # The command line, in its own process, writes the same bytes as the function.
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in TINY.items()]
    subprocess.run([sys.executable, SCRIPT, str(tmp_path / "cli"), "--seed=3", *flags], check=True,
                   capture_output=True, timeout=120, env={**os.environ, **envs.compute_thread_env(1)})
    for name in CHECKPOINT_FILES:
        expected = (tmp_path / "a" / name).read_bytes()
        assert (tmp_path / "b" / name).read_bytes() == expected, name
        assert (tmp_path / "cli" / name).read_bytes() == expected, f"CLI {name}"
    a, c = load_file(os.path.join(first, "model.safetensors")), load_file(os.path.join(other, "model.safetensors"))
    assert sorted(a) == sorted(c)
    expert = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert a[expert].shape == (TINY["hidden"], TINY["moe_intermediate"])
    assert not np.array_equal(a[expert], c[expert])
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    np.testing.assert_array_equal(a["model.norm.weight"], np.ones(TINY["hidden"], dtype=np.float32))
    assert again == str(tmp_path / "b")


def test_config_of_generated_checkpoint(tiny_dir) -> None:
    config = load_model_config(tiny_dir)
    assert (config.architecture, config.format, config.vocab_size) == ("qwen3_moe", "safetensors", 49152)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 32)
    assert config.qk_norm and not config.attention_bias and config.norm_topk_prob
    assert config.eos_token_ids == [2]
    assert [config.is_moe_layer(layer) for layer in range(2)] == [True, True]
    with open(os.path.join(tiny_dir, "config.json"), encoding="utf-8") as handle:
        assert json.load(handle)["architectures"] == ["Qwen3MoeForCausalLM"]


def test_generated_tokenizer_encodes_like_the_gguf(tiny_dir) -> None:
    generated, gguf_tok = load_tokenizer(tiny_dir), load_tokenizer(default_model_path())
    reference = load_reference()
    texts = [entry["chat_text"] for entry in reference]
    texts += ["The year 2024 had 366 days.", "héllo 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n",
              "  spaced\t\ttabs\n"]
    for text in texts:
        ids = gguf_tok.encode(text)
        assert generated.encode(text) == ids, text
        assert generated.decode(ids, skip_special_tokens=False) == gguf_tok.decode(ids, skip_special_tokens=False)
        assert generated.decode(ids) == gguf_tok.decode(ids)
    assert (generated.bos_token_id, generated.eos_token_ids) == (gguf_tok.bos_token_id, gguf_tok.eos_token_ids)
    assert generated.vocab_size == gguf_tok.vocab_size == 49152
    assert generated.has_chat_template
    for entry in reference:
        # The template (with SmolLM's default system prompt) renders as the reference's did.
        assert generated.apply_chat_template([{"role": "user", "content": entry["prompt"]}]) == entry["chat_text"]


# --------------------------------------------------------------------------- model vs numpy


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def _swiglu(x: np.ndarray, w: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    gate, up = w[prefix + "gate_proj.weight"] @ x, w[prefix + "up_proj.weight"] @ x
    return w[prefix + "down_proj.weight"] @ (gate / (1.0 + np.exp(-gate)) * up)


def _reference_moe(hf: dict, w: dict[str, np.ndarray], prefix: str, hidden: np.ndarray) -> np.ndarray:
    """Token by token, expert by expert: softmax router, top-k, optional renormalisation, shared expert."""
    top_k = hf["num_experts_per_tok"]
    out = np.zeros_like(hidden)
    for token, x in enumerate(hidden):
        logits = w[prefix + "gate.weight"] @ x
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        ranked = np.argsort(-probs, kind="stable")
        # A near-tie at the k-th place would make the comparison depend on rounding, not on correctness.
        if probs[ranked[top_k - 1]] - probs[ranked[top_k]] < 1e-5:
            raise RuntimeError(f"router near-tie at token {token} in {prefix}: pick another seed for this test")
        chosen = ranked[:top_k]
        weights = probs[chosen] / (probs[chosen].sum() if hf["norm_topk_prob"] else 1.0)
        for expert, weight in zip(chosen, weights):
            out[token] += weight * _swiglu(x, w, f"{prefix}experts.{expert}.")
        if hf.get("shared_expert_intermediate_size", 0):
            gate = w[prefix + "shared_expert_gate.weight"] @ x
            out[token] += 1.0 / (1.0 + np.exp(-gate)) * _swiglu(x, w, prefix + "shared_expert.")
    return out


def reference_logits(hf: dict, weights: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Dense float64 forward of one sequence from the HF config dict: logits at every position."""
    w = {name: array.astype(np.float64) for name, array in weights.items()}
    heads, kv_heads, dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    eps, length = hf["rms_norm_eps"], len(tokens)
    qwen3 = hf["model_type"] == "qwen3_moe"
    inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    angles = np.outer(np.arange(length), inv_freq)
    cos, sin = np.cos(np.concatenate([angles, angles], 1)), np.sin(np.concatenate([angles, angles], 1))

    def rope(x: np.ndarray) -> np.ndarray:
        rotated = np.concatenate([-x[..., dim // 2:], x[..., : dim // 2]], -1)
        return x * cos[:, None] + rotated * sin[:, None]

    x = w["model.embed_tokens.weight"][tokens]
    causal = np.triu(np.full((length, length), -np.inf), 1)
    for layer in range(hf["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        if not qwen3:
            q, k, v = (y + w[p + f"self_attn.{n}_proj.bias"] for y, n in zip((q, k, v), "qkv"))
        q, k, v = q.reshape(length, heads, dim), k.reshape(length, kv_heads, dim), v.reshape(length, kv_heads, dim)
        if qwen3:
            q, k = _rms(q, w[p + "self_attn.q_norm.weight"], eps), _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dim) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", probs, v).reshape(length, heads * dim) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        sparse = layer not in hf["mlp_only_layers"] and (layer + 1) % hf["decoder_sparse_step"] == 0
        if sparse:
            x = x + _reference_moe(hf, w, p + "mlp.", h)
        else:
            x = x + np.stack([_swiglu(row, w, p + "mlp.") for row in h])
    head = w["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else w["lm_head.weight"]
    return _rms(x, w["model.norm.weight"], eps) @ head.T


VARIANTS = {
    # Qwen3-MoE: QK norm, renormalised top-2 of 4, untied head, a dense layer in the middle.
    "qwen3_moe": dict(TINY, layers=3, mlp_only_layers=(1,), tie_word_embeddings=False),
    # Qwen2-MoE: QKV bias, raw top-3 of 6 weights, shared expert, only every second layer sparse.
    "qwen2_moe": dict(TINY, model_type="qwen2_moe", experts=6, top_k=3, norm_topk_prob=False,
                      shared_expert_intermediate=48, decoder_sparse_step=2),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_dense_numpy_reference(variant: str, tmp_path, monkeypatch) -> None:
    """Chunked prefill, a prefix chunk beside a decode, and batched decodes of unequal lengths."""
    # A 5-row query tile makes prefill chunks span several tiles, as long prompts do.
    monkeypatch.setattr(attention, "_PREFILL_QUERY_TILE", 5)
    path = make_tiny_moe(str(tmp_path), seed=11, **VARIANTS[variant])
    config = load_model_config(path)
    weights = load_weights(config)
    model = get_model_class(config.architecture)(config)
    model.load_weights(weights)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as handle:
        hf = json.load(handle)
    assert config.architecture == variant

    kv_caches = new_kv_caches(config)
    rng = np.random.default_rng(5)
    seqs = {"a": rng.integers(0, config.vocab_size, 16).tolist(), "b": rng.integers(0, config.vocab_size, 12).tolist()}
    tables = {"a": [9, 3, 14, 0], "b": [2, 11, 6, 15]}
    produced = run_schedule(model, kv_caches, seqs, tables, TWO_SEQUENCE_SCHEDULE, BLOCK_SIZE)
    for name, tokens in seqs.items():
        ours = produced[name]
        expected = reference_logits(hf, weights, tokens[: len(ours)])
        np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4, err_msg=f"{variant} sequence {name}")


# --------------------------------------------------------------------------- paged cache


def test_paged_greedy_equals_full_recompute(tiny, reference_prompts) -> None:
    config, _weights, model = tiny
    prompts = reference_prompts[:2]
    paged = greedy_paged(model, config, prompts, new_tokens=16)
    for prompt, output in zip(prompts, paged):
        assert output == greedy_recompute(model, config, prompt, new_tokens=16)
        # A random model talks gibberish, but it must not collapse onto one token.
        assert len(set(output)) >= 4, output
    assert paged[0] != paged[1]


# --------------------------------------------------------------------------- expert parallelism


class InProcessGroup:
    """Stand-in for the EP collective: ranks run in threads; all_reduce_sum is a barrier, then a sum in rank order."""

    def __init__(self, world_size: int) -> None:
        self._barrier = threading.Barrier(world_size, timeout=60)
        self._slots: list[np.ndarray | None] = [None] * world_size

    def all_reduce_sum(self, rank: int, tensor: paddle.Tensor) -> paddle.Tensor:
        self._slots[rank] = tensor.numpy()
        self._barrier.wait()
        total = self._slots[0].copy()
        for partial in self._slots[1:]:
            total += partial
        self._barrier.wait()  # every rank has read the slots before any overwrites its own
        return paddle.to_tensor(total)

    def abort(self) -> None:
        """Release the other rank at once when one fails, instead of after the barrier timeout."""
        self._barrier.abort()


class RankEP:
    """One rank's view of the group: the ``ExpertParallel`` protocol the model calls."""

    def __init__(self, group: InProcessGroup, rank: int, local_expert_ids: list[int]) -> None:
        self.group, self.rank, self.local_expert_ids = group, rank, local_expert_ids
        self.calls = 0

    def all_reduce_sum(self, tensor: paddle.Tensor) -> paddle.Tensor:
        self.calls += 1
        return self.group.all_reduce_sum(self.rank, tensor)


def _local_weights(weights: dict[str, np.ndarray], local_expert_ids: list[int]) -> dict[str, np.ndarray]:
    """The checkpoint minus every other rank's experts: a rank must not need them."""
    local = {f".experts.{expert}." for expert in local_expert_ids}
    return {name: array for name, array in weights.items()
            if ".experts." not in name or any(marker in name for marker in local)}


@pytest.mark.parametrize("split", [([0, 2], [1, 3]), ([3], [2, 0, 1])], ids=["even", "uneven"])
def test_two_rank_expert_split_equals_single_process(tiny, reference_prompts, split) -> None:
    config, weights, model = tiny
    prompts = reference_prompts[:2]
    new_tokens = 8
    single = greedy_paged(model, config, prompts, new_tokens)
    single_logits = forward_logits(model, new_kv_caches(config), [(prompts[0], len(prompts[0]), [0, 1, 2, 3])])

    group = InProcessGroup(world_size=2)
    ranks = [RankEP(group, rank, list(ids)) for rank, ids in enumerate(split)]
    rank_models = [load_rank_model(config.path, ep, _local_weights(weights, ep.local_expert_ids)) for ep in ranks]

    def run_rank(rank_model) -> tuple[list[list[int]], np.ndarray]:
        try:
            logits = forward_logits(rank_model, new_kv_caches(config), [(prompts[0], len(prompts[0]), [0, 1, 2, 3])])
            return greedy_paged(rank_model, config, prompts, new_tokens), logits
        except BaseException:
            group.abort()
            raise

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = [future.result(timeout=300) for future in [pool.submit(run_rank, m) for m in rank_models]]

    for outputs, logits in results:
        np.testing.assert_allclose(logits, single_logits, rtol=1e-5, atol=1e-5)
        assert outputs == single
    # One collective per sparse layer per forward on every rank, also when its experts got no token.
    forwards = 1 + new_tokens
    assert [ep.calls for ep in ranks] == [forwards * config.num_hidden_layers] * 2


class OwnExperts:
    """An expert-parallel rank holding ``local_expert_ids``, for loading only (its all-reduce is the identity)."""

    def __init__(self, local_expert_ids: list[int]) -> None:
        self.local_expert_ids = local_expert_ids

    def all_reduce_sum(self, tensor: paddle.Tensor) -> paddle.Tensor:
        return tensor


def test_rank_without_its_experts_weights_fails_to_load(tiny) -> None:
    config, weights, _model = tiny
    model = get_model_class(config.architecture)(config, ep=OwnExperts([0, 1]))
    with pytest.raises(KeyError, match=r"experts\.1\."):
        model.load_weights(_local_weights(weights, [0]))


def test_expert_parallel_rank_reads_only_its_experts(tiny) -> None:
    config, weights, _model = tiny
    model = get_model_class(config.architecture)(config, ep=OwnExperts([3, 1]))
    loaded = load_weights(config, keep=model.needs_weight)
    assert set(loaded) == set(_local_weights(weights, [1, 3]))
    assert any(".experts.1." in name for name in loaded) and any(".experts.3." in name for name in loaded)
    assert not any(".experts.0." in name or ".experts.2." in name for name in loaded)
    model.load_weights(loaded)
    assert sorted(model.local_expert_ids) == [1, 3]


def test_invalid_local_expert_ids_are_rejected(tiny) -> None:
    config, _weights, _model = tiny

    class OutOfRange:
        local_expert_ids = [0, config.num_experts]

        def all_reduce_sum(self, tensor: paddle.Tensor) -> paddle.Tensor:
            return tensor

    with pytest.raises(ValueError, match="outside"):
        MoEForCausalLM(config, ep=OutOfRange())


def test_checkpoint_missing_an_expert_is_named(tmp_path) -> None:
    path = make_tiny_moe(str(tmp_path), seed=0, **TINY)
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.0.mlp.experts.2.up_proj.weight"]
    from safetensors.numpy import save_file

    save_file(weights, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj"):
        load_weights(load_model_config(path))
