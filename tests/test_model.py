"""The Llama model, its loaders and paged attention, on the real SmolLM2-135M GGUF.

Greedy outputs are checked against ``<repo_root>/../shared/reference/smollm2_greedy.json``
(float32 greedy decoding by Hugging Face transformers): token for token up to the first
step whose top-2 logit margin is below 0.01, where float32 summation order may flip it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import envs

envs.apply_compute_thread_env(2)

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import pytest  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

from worker import attention  # noqa: E402
from cache_manager.kv_layout import device_cache_shape  # noqa: E402
from worker.attention import build_attention_metadata, kv_cache_views  # noqa: E402
from worker.loader import load_weights  # noqa: E402
from config.model_config import ModelConfig, default_model_path, hf_config_dict, load_model_config  # noqa: E402
from worker.models import get_model_class  # noqa: E402
from tests.model_utils import TWO_SEQUENCE_SCHEDULE, run_schedule  # noqa: E402
from worker.models import llama as llama_module  # noqa: E402
from harness.reference import load_reference  # noqa: E402

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 2
MARGIN_THRESHOLD = 0.01
BLOCK_SIZE = 16
NUM_BLOCKS = 64


class Sequence:
    """A prompt being greedily decoded; its blocks are deliberately scattered over the cache."""

    def __init__(self, entry: dict, blocks: list[int]) -> None:
        self.prompt = list(entry["prompt_ids"])
        self.max_new = len(entry["output_ids"])
        self.blocks = blocks
        self.output: list[int] = []
        self.computed = 0  # tokens whose k/v are in the cache

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_new or (bool(self.output) and self.output[-1] == EOS)


def checked_length(entry: dict) -> int:
    """Number of leading reference tokens that must match exactly."""
    for step, margin in enumerate(entry["top2_margins"]):
        if margin < MARGIN_THRESHOLD:
            return step
    return len(entry["output_ids"])


def assert_matches_reference(entry: dict, output: list[int]) -> None:
    length = checked_length(entry)
    assert length > 0, "reference entry has nothing to compare"
    assert output[:length] == entry["output_ids"][:length], (
        f"prompt {entry['prompt']!r}: got {output[:length]}, expected {entry['output_ids'][:length]}"
    )


def scattered_blocks(count: int, seed: int) -> list[list[int]]:
    """Disjoint block tables drawn from a shuffled pool, so paging (not contiguity) is exercised."""
    pool = np.random.default_rng(seed).permutation(NUM_BLOCKS).tolist()
    per_sequence = NUM_BLOCKS // count
    return [pool[i * per_sequence:(i + 1) * per_sequence] for i in range(count)]


def run_step(model, kv_caches, work: list[tuple[Sequence, int]]) -> None:
    """One forward over ``(sequence, new_tokens)`` pairs (decodes first); greedy-sample finished prompts."""
    query_lens, context_lens, tables, input_ids = [], [], [], []
    for seq, count in work:
        tokens = seq.tokens[seq.computed: seq.computed + count]
        input_ids += tokens
        query_lens.append(count)
        context_lens.append(seq.computed + count)
        tables.append(seq.blocks)
    meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE)
    hidden = model(paddle.to_tensor(input_ids, dtype="int64"), meta.positions, kv_caches, meta)
    logits = model.compute_logits(paddle.index_select(hidden, meta.last_token_indices))
    next_tokens = logits.argmax(axis=-1).numpy().tolist()
    for (seq, count), token in zip(work, next_tokens):
        seq.computed += count
        if seq.computed == len(seq.tokens):  # the whole known sequence is cached: sample
            seq.output.append(int(token))


def new_cache(config: ModelConfig) -> tuple[np.ndarray, list]:
    array = np.zeros(device_cache_shape(config, NUM_BLOCKS, BLOCK_SIZE), dtype=np.float32)
    return array, kv_cache_views(array)


def decode_until_done(model, kv_caches, sequences: list[Sequence]) -> None:
    while True:
        active = [seq for seq in sequences if not seq.finished]
        if not active:
            return
        run_step(model, kv_caches, [(seq, 1) for seq in active])


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return load_reference()


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return load_model_config(default_model_path())


@pytest.fixture(scope="module")
def weights(config: ModelConfig) -> dict[str, np.ndarray]:
    return load_weights(config)


@pytest.fixture(scope="module")
def model(config: ModelConfig, weights: dict[str, np.ndarray]):
    instance = get_model_class(config.architecture)(config)
    instance.load_weights(weights)
    return instance


def test_config_of_default_gguf(config: ModelConfig) -> None:
    assert (config.architecture, config.hidden_size, config.num_hidden_layers) == ("llama", 576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and config.eos_token_ids == [EOS]
    assert config.rms_norm_eps == 1e-5 and config.rope_theta == 100000.0
    assert len(config.model_fingerprint) == 16
    assert load_model_config(config.path).model_fingerprint == config.model_fingerprint


def test_greedy_one_at_a_time(model, config, reference) -> None:
    for index, entry in enumerate(reference):
        _array, kv_caches = new_cache(config)
        seq = Sequence(entry, scattered_blocks(1, seed=index)[0])
        run_step(model, kv_caches, [(seq, len(seq.prompt))])
        decode_until_done(model, kv_caches, [seq])
        assert_matches_reference(entry, seq.output)


def test_greedy_with_native_kernels_off(config, weights, reference, monkeypatch) -> None:
    """FD_NATIVE_KERNELS=0 (what runs where no compiler or no AVX-512 is found): Paddle attention, RoPE,
    norms and matmuls reproduce the references too, a batch of all prompts decoding together."""
    monkeypatch.setenv("FD_NATIVE_KERNELS", "0")
    paddle_only = get_model_class(config.architecture)(config)
    paddle_only.load_weights(weights)
    assert not paddle_only.native_fused and not paddle_only._fused_attention() and not paddle_only._small_linear
    _array, kv_caches = new_cache(config)
    tables = scattered_blocks(len(reference), seed=77)
    sequences = [Sequence(entry, table) for entry, table in zip(reference, tables)]
    for seq in sequences:
        run_step(paddle_only, kv_caches, [(seq, len(seq.prompt))])
    decode_until_done(paddle_only, kv_caches, sequences)
    for entry, seq in zip(reference, sequences):
        assert_matches_reference(entry, seq.output)


def test_greedy_chunked_prefill(model, config, reference) -> None:
    for index, entry in enumerate(reference):
        _array, kv_caches = new_cache(config)
        seq = Sequence(entry, scattered_blocks(1, seed=100 + index)[0])
        while seq.computed < len(seq.prompt):
            run_step(model, kv_caches, [(seq, min(16, len(seq.prompt) - seq.computed))])
        decode_until_done(model, kv_caches, [seq])
        assert_matches_reference(entry, seq.output)


def test_greedy_batched_decode(model, config, reference) -> None:
    _array, kv_caches = new_cache(config)
    tables = scattered_blocks(len(reference), seed=7)
    sequences = [Sequence(entry, table) for entry, table in zip(reference, tables)]
    # Every prompt prefilled in one step (several prefill chunks), then one decode batch that shrinks as prompts end.
    run_step(model, kv_caches, [(seq, len(seq.prompt)) for seq in sequences])
    decode_until_done(model, kv_caches, sequences)
    for entry, seq in zip(reference, sequences):
        assert_matches_reference(entry, seq.output)


def test_greedy_mixed_decode_and_prefill_steps(model, config, reference) -> None:
    """Each step decodes the running prompts and prefills a chunk of the next one, as the scheduler will."""
    _array, kv_caches = new_cache(config)
    tables = scattered_blocks(len(reference), seed=11)
    waiting = [Sequence(entry, table) for entry, table in zip(reference, tables)]
    running: list[Sequence] = []
    while waiting or any(not seq.finished for seq in running):
        work = [(seq, 1) for seq in running if not seq.finished]
        if waiting:
            seq = waiting[0]
            work.append((seq, min(24, len(seq.prompt) - seq.computed)))
            if seq.computed + work[-1][1] == len(seq.prompt):
                running.append(waiting.pop(0))
        run_step(model, kv_caches, work)
    for entry, seq in zip(reference, running):
        assert_matches_reference(entry, seq.output)


def test_cache_writes_land_in_numpy_array(model, config, reference) -> None:
    array, kv_caches = new_cache(config)
    entry = reference[0]
    seq = Sequence(entry, scattered_blocks(1, seed=3)[0])
    run_step(model, kv_caches, [(seq, len(seq.prompt))])

    written = np.zeros((NUM_BLOCKS, BLOCK_SIZE), dtype=bool)
    for position in range(len(seq.prompt)):
        written[seq.blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = True
    nonzero = np.abs(array).sum(axis=5) > 0  # [layers, 2, blocks, kv_heads, block_size]
    every_head = nonzero.all(axis=3)  # [layers, 2, blocks, block_size]
    any_head = nonzero.any(axis=3)
    assert every_head[:, :, written].all(), "some prompt slot was not written for every KV head"
    assert not any_head[:, :, ~written].any(), "a slot outside the prompt's block table was written"

    # The cache content lives in the array: a copy of it continues the sequence identically.
    copied = kv_cache_views(array.copy())
    meta = build_attention_metadata([1], [len(seq.prompt) + 1], [seq.blocks], BLOCK_SIZE)
    token = paddle.to_tensor(seq.output, dtype="int64")
    from_original = model.compute_logits(model(token, meta.positions, kv_caches, meta)).numpy()
    from_copy = model.compute_logits(model(token, meta.positions, copied, meta)).numpy()
    np.testing.assert_array_equal(from_original, from_copy)
    assert int(from_copy.argmax()) == entry["output_ids"][1]


def test_kv_cache_views_reject_unusable_arrays(config) -> None:
    shape = device_cache_shape(config, 2, BLOCK_SIZE)
    with pytest.raises(ValueError, match="float32"):
        kv_cache_views(np.zeros(shape, dtype=np.float64))
    with pytest.raises(ValueError, match="contiguous"):
        kv_cache_views(np.zeros(shape[:-1] + (shape[-1] * 2,), dtype=np.float32)[..., ::2])


def test_metadata_requires_decodes_first() -> None:
    with pytest.raises(ValueError, match="decode sequences"):
        build_attention_metadata([4, 1], [4, 9], [[0], [1]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="blocks"):
        build_attention_metadata([1], [BLOCK_SIZE + 1], [[0]], BLOCK_SIZE)


def test_safetensors_directory_round_trip(model, config, weights, reference, tmp_path) -> None:
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, shard_names in shards.items():
        save_file({name: weights[name] for name in shard_names}, str(tmp_path / shard))
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(config)))

    loaded_config = load_model_config(str(tmp_path))
    assert loaded_config.format == "safetensors"
    for field_name in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                       "tie_word_embeddings", "attention_bias", "qk_norm", "bos_token_id", "eos_token_ids"):
        assert getattr(loaded_config, field_name) == getattr(config, field_name), field_name
    reloaded = get_model_class(loaded_config.architecture)(loaded_config)
    reloaded.load_weights(load_weights(loaded_config))

    prompt = reference[0]["prompt_ids"]
    logits = []
    for candidate in (model, reloaded):
        _array, kv_caches = new_cache(config)
        meta = build_attention_metadata([len(prompt)], [len(prompt)], [list(range(NUM_BLOCKS))], BLOCK_SIZE)
        hidden = candidate(paddle.to_tensor(prompt, dtype="int64"), meta.positions, kv_caches, meta)
        logits.append(candidate.compute_logits(hidden).numpy())
    np.testing.assert_array_equal(logits[0], logits[1])


def test_bf16_safetensors_widen_exactly(tmp_path) -> None:
    """numpy has no bfloat16; the loader widens the raw bits, so bf16-representable values survive exactly."""
    small = ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
        bos_token_id=1, eos_token_ids=[2],
    )
    shapes = {
        "model.embed_tokens.weight": (32, 16), "model.norm.weight": (16,),
        "model.layers.0.input_layernorm.weight": (16,), "model.layers.0.post_attention_layernorm.weight": (16,),
        "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
        "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.o_proj.weight": (16, 16),
        "model.layers.0.mlp.gate_proj.weight": (24, 16), "model.layers.0.mlp.up_proj.weight": (24, 16),
        "model.layers.0.mlp.down_proj.weight": (16, 24),
    }
    rng = np.random.default_rng(0)
    expected, header, blobs, offset = {}, {}, [], 0
    for name, shape in shapes.items():
        bits = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        expected[name] = (bits.astype(np.uint32) << 16).view(np.float32)
        blob = bits.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header).encode("utf-8")
    with open(tmp_path / "model.safetensors", "wb") as handle:
        handle.write(len(header_bytes).to_bytes(8, "little") + header_bytes + b"".join(blobs))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(small)))

    loaded = load_weights(load_model_config(str(tmp_path)))
    assert sorted(loaded) == sorted(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], array)


def tiny_config(architecture: str, tie: bool) -> ModelConfig:
    return ModelConfig(
        architecture=architecture, vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=64, tie_word_embeddings=tie, attention_bias=architecture == "qwen2",
        qk_norm=architecture == "qwen3", bos_token_id=1, eos_token_ids=[2],
    )


def random_weights(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    from worker.loader import expected_weight_names

    rng = np.random.default_rng(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {
        "q_proj.weight": (q_out, hidden), "k_proj.weight": (kv_out, hidden), "v_proj.weight": (kv_out, hidden),
        "o_proj.weight": (hidden, q_out), "q_proj.bias": (q_out,), "k_proj.bias": (kv_out,), "v_proj.bias": (kv_out,),
        "q_norm.weight": (config.head_dim,), "k_norm.weight": (config.head_dim,),
        "gate_proj.weight": (inter, hidden), "up_proj.weight": (inter, hidden), "down_proj.weight": (hidden, inter),
        "embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
    }
    weights = {}
    for name in expected_weight_names(config):
        suffix = ".".join(name.split(".")[-2:])
        if suffix in shapes:
            weights[name] = (rng.standard_normal(shapes[suffix]) * 0.3).astype(np.float32)
        else:  # norm weights
            weights[name] = (1.0 + 0.2 * rng.standard_normal(hidden)).astype(np.float32)
    return weights


def numpy_reference_logits(config: ModelConfig, weights: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Plain dense float64 forward (Hugging Face semantics) of one sequence: logits at every position."""
    w = {name: array.astype(np.float64) for name, array in weights.items()}
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    length = len(tokens)

    def rms(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + config.rms_norm_eps) * weight

    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, dim, 2) / dim)
    angles = np.outer(np.arange(length), inv_freq)
    cos, sin = np.cos(np.concatenate([angles, angles], 1)), np.sin(np.concatenate([angles, angles], 1))

    def rope(x: np.ndarray) -> np.ndarray:  # [length, heads, dim]
        rotated = np.concatenate([-x[..., dim // 2:], x[..., : dim // 2]], -1)
        return x * cos[:, None] + rotated * sin[:, None]

    x = w["model.embed_tokens.weight"][tokens]
    causal = np.triu(np.full((length, length), -np.inf), 1)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
        if config.attention_bias:
            q, k, v = (x_ + w[p + f"self_attn.{n}_proj.bias"] for x_, n in zip((q, k, v), "qkv"))
        q, k, v = q.reshape(length, heads, dim), k.reshape(length, kv_heads, dim), v.reshape(length, kv_heads, dim)
        if config.qk_norm:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dim) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", probs, v).reshape(length, heads * dim) @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return rms(x, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("query_tile", [None, 5], ids=["default-tile", "tile-5"])
@pytest.mark.parametrize("architecture,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_architectures_match_dense_numpy_reference(architecture: str, tie: bool, query_tile, monkeypatch) -> None:
    """Qwen2 bias, Qwen3 QK norm and untied heads, through chunked, mixed and batched-decode steps.

    With a 5-row query tile, prefill chunks span several tiles (with and without a cached
    prefix), which the real prompts (< 128 tokens) never do.
    """
    if query_tile is not None:
        monkeypatch.setattr(attention, "_PREFILL_QUERY_TILE", query_tile)
    config = tiny_config(architecture, tie)
    weights = random_weights(config, seed=len(architecture))
    model = get_model_class(architecture)(config)
    model.load_weights(weights)
    block_size, num_blocks = 4, 16
    kv_caches = kv_cache_views(np.zeros(device_cache_shape(config, num_blocks, block_size), dtype=np.float32))
    rng = np.random.default_rng(5)
    seqs = {"a": rng.integers(0, config.vocab_size, 16).tolist(), "b": rng.integers(0, config.vocab_size, 12).tolist()}
    tables = {"a": [9, 3, 14, 0, 7, 1, 12, 5], "b": [2, 11, 6, 15, 4, 8, 10, 13]}
    produced = run_schedule(model, kv_caches, seqs, tables, TWO_SEQUENCE_SCHEDULE, block_size)
    for name, tokens in seqs.items():
        ours = produced[name]
        expected = numpy_reference_logits(config, weights, tokens[: len(ours)])
        np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4, err_msg=f"{architecture} sequence {name}")


def test_unsupported_architecture_is_named(tmp_path) -> None:
    hf_config = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(ValueError, match="gpt_neox"):
        load_model_config(str(tmp_path))


def aliasing_config() -> ModelConfig:
    """Tiny Llama whose gate_up rows (2 x 512 floats) and tied LM head rows (1024 floats) are 4 KiB long."""
    return dataclasses.replace(tiny_config("llama", tie=True), intermediate_size=512, vocab_size=1024)


def logits_of_schedule(model, config: ModelConfig, tokens: list[int], prefill: int) -> np.ndarray:
    """Logits at every position of one sequence: ``prefill`` tokens in one step, then one token per step."""
    block_size = 4
    table = list(range(-(-len(tokens) // block_size)))[::-1]  # reversed: paging, not contiguity
    kv_caches = kv_cache_views(np.zeros(device_cache_shape(config, len(table), block_size), dtype=np.float32))
    chunks = [tokens[:prefill]] + [[token] for token in tokens[prefill:]]
    produced, done = [], 0
    for chunk in chunks:
        done += len(chunk)
        meta = build_attention_metadata([len(chunk)], [done], [table], block_size)
        hidden = model(paddle.to_tensor(chunk, dtype="int64"), meta.positions, kv_caches, meta)
        produced.append(model.compute_logits(hidden).numpy())
    return np.concatenate(produced)


def test_padded_weights_match_dense_numpy_reference() -> None:
    """gate_up and LM head rows of 4 KiB get zero columns (a CPU GEMM speed-up); outputs must not change."""
    config = aliasing_config()
    weights = random_weights(config, seed=21)
    model = get_model_class("llama")(config)
    model.load_weights(weights)
    # The padding must actually be exercised by this config, or the test proves nothing.
    assert model._lm_head.shape[1] > config.vocab_size
    assert model._layers[0].gate_up.shape[1] > 2 * config.intermediate_size
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, 11).tolist()
    ours = logits_of_schedule(model, config, tokens, prefill=6)
    assert ours.shape == (len(tokens), config.vocab_size)
    expected = numpy_reference_logits(config, weights, tokens)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_folded_attention_scale_is_bit_identical(architecture: str, monkeypatch) -> None:
    """head_dim 16: the 0.25 scale is folded into the Q weights (and bias); every logit must be unchanged."""
    config = tiny_config(architecture, tie=False)
    weights = random_weights(config, seed=4)
    folded = get_model_class(architecture)(config)
    folded.load_weights(weights)
    monkeypatch.setattr(llama_module, "_exact_power_of_two", lambda value: False)
    scaled = get_model_class(architecture)(config)
    scaled.load_weights(weights)
    assert folded._layers[0].q_prescaled and not scaled._layers[0].q_prescaled
    tokens = np.random.default_rng(8).integers(0, config.vocab_size, 12).tolist()
    np.testing.assert_array_equal(logits_of_schedule(folded, config, tokens, prefill=7),
                                  logits_of_schedule(scaled, config, tokens, prefill=7))


@pytest.mark.parametrize("head_dim", [16, 64], ids=["scalar-rope", "avx512-rope"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_fused_rope_attention_is_bit_identical(architecture: str, head_dim: int) -> None:
    """fd_rope_paged_attention (RoPE + cache write + attention in one op) against Paddle RoPE + scatter +
    fd_paged_attention: the same logits and the same cache bytes, through a prefill and decodes."""
    from worker.attention import use_native_kernel

    if not use_native_kernel():
        pytest.skip("native kernels unavailable here (tests/test_kernels_build.py covers the fallback)")
    config = dataclasses.replace(tiny_config(architecture, tie=False), head_dim=head_dim)
    weights = random_weights(config, seed=head_dim)
    fused = get_model_class(architecture)(config)
    fused.load_weights(weights)
    composed = get_model_class(architecture)(config)
    composed.load_weights(weights)
    composed._fused_attention = lambda: False
    assert fused._fused_attention()
    tokens = np.random.default_rng(9).integers(0, config.vocab_size, 40).tolist()
    block_size = 4
    table = list(range(-(-len(tokens) // block_size)))[::-1]
    caches = {}
    logits = {}
    for name, model in (("fused", fused), ("composed", composed)):
        array = np.zeros(device_cache_shape(config, len(table), block_size), dtype=np.float32)
        kv_caches = kv_cache_views(array)
        produced, done = [], 0
        for chunk in [tokens[:33]] + [[token] for token in tokens[33:]]:
            done += len(chunk)
            meta = build_attention_metadata([len(chunk)], [done], [table], block_size)
            hidden = model(paddle.to_tensor(chunk, dtype="int64"), meta.positions, kv_caches, meta)
            produced.append(model.compute_logits(hidden).numpy())
        caches[name], logits[name] = array, np.concatenate(produced)
    np.testing.assert_array_equal(caches["fused"], caches["composed"])
    np.testing.assert_array_equal(logits["fused"], logits["composed"])
