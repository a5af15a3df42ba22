"""benchmarks/hf_export.py: the exported directory holds exactly the loader's float32 weights."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from hf_export import MARKER_FILE, WEIGHTS_FILE, ExportError, export_hf_directory, is_current  # noqa: E402

from config.model_config import load_model_config  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from scripts.make_tiny_dense import make_tiny_dense  # noqa: E402
from worker.loader import load_weights  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return make_tiny_dense(str(tmp_path_factory.mktemp("tiny")), seed=7, model_type="llama")


def test_export_round_trips_weights_config_and_tokenizer(source, tmp_path) -> None:
    from safetensors.numpy import load_file

    out = export_hf_directory(str(tmp_path / "hf"), source)
    expected = load_weights(load_model_config(source))
    exported = load_file(os.path.join(out, WEIGHTS_FILE))
    tied = load_model_config(source).tie_word_embeddings
    assert sorted(exported) == sorted(name for name in expected if not (tied and name == "lm_head.weight"))
    for name, array in exported.items():
        assert array.dtype == np.float32, name
        np.testing.assert_array_equal(array, expected[name], err_msg=name)

    source_config, exported_config = load_model_config(source), load_model_config(out)
    for field_name in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                       "tie_word_embeddings", "bos_token_id", "eos_token_ids"):
        assert getattr(exported_config, field_name) == getattr(source_config, field_name), field_name
    text = "The capital of France is Paris, 2024."
    assert load_tokenizer(out).encode(text) == load_tokenizer(source).encode(text)


def test_export_is_reused_while_the_source_is_unchanged(source, tmp_path) -> None:
    out = str(tmp_path / "hf")
    export_hf_directory(out, source)
    assert is_current(out, source)
    weights = os.path.join(out, WEIGHTS_FILE)
    before = os.stat(weights).st_mtime_ns
    export_hf_directory(out, source)
    assert os.stat(weights).st_mtime_ns == before  # not rewritten

    marker = os.path.join(out, MARKER_FILE)
    with open(marker, encoding="utf-8") as handle:
        identity = json.load(handle)
    identity["size"] += 1  # as if the source checkpoint had changed
    with open(marker, "w", encoding="utf-8") as handle:
        json.dump(identity, handle)
    assert not is_current(out, source)
    export_hf_directory(out, source)
    assert is_current(out, source)
    assert not os.path.exists(f"{out}.partial")


def test_export_of_a_missing_model_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ExportError, match="does not exist"):
        export_hf_directory(str(tmp_path / "hf"), str(tmp_path / "missing.gguf"))
