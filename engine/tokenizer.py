"""Text <-> token ids and chat rendering for the API server.

Owns: building a Hugging Face ``tokenizers.Tokenizer`` from a GGUF file's
byte-level BPE vocabulary (or loading one from a HF model directory), the
special-token and eos bookkeeping, and rendering chat messages with the model's
jinja2 chat template. Runs in the API-server process only: no paddle here.

Chat template fallback: a model that ships no template is rendered with plain
ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
``<|im_start|>assistant\\n`` when a generation prompt is asked for), with no
default system prompt.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from config.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

CHATML_FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# llama.cpp's token_type values (gguf.TokenType); only these two change how we build the vocabulary.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Pre-tokenizer split patterns of llama.cpp's pre-tokenizer types (llama-vocab.cpp). They are
# matched by the tokenizers crate's Oniguruma engine, which understands \p{..} and (?i:..).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer:
    """A loaded tokenizer: encode/decode, eos ids and the chat template.

    Wraps a ``tokenizers.Tokenizer`` (the ``backend``) rather than subclassing it, so the
    rest of fdserve depends on this small surface only.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a tokenizer needs at least one eos token id")
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        for token_id in (bos_token_id, *self.eos_token_ids):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"special token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        self.has_chat_template = chat_template is not None
        if chat_template is None:
            logger.info("the model ships no chat template; using the plain ChatML fallback")
            chat_template = CHATML_FALLBACK_TEMPLATE
        self.chat_template: str = chat_template
        self._compiled_template = _compile_chat_template(chat_template)

    @property
    def backend(self) -> HFTokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (e.g. to save it as tokenizer.json)."""
        return self._backend

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self.id_to_token(self.eos_token_ids[0]) or ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their single ids.

        ``add_special_tokens`` lets the post-processor add what the model wants around a
        sequence (BOS for models whose metadata asks for it); chat prompts don't need it
        because the template already writes the special tokens.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 at the end decodes to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level form), None if out of range."""
        if token_id < 0:
            return None
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` to the prompt text the model was trained on.

        Raises ``InvalidRequestError`` (a ValueError, an HTTP 400 upstream) for malformed
        messages and for templates that reject them (``raise_exception``) or fail on them.
        """
        prepared = _prepare_messages(messages)
        try:
            return self._compiled_template.render(
                messages=prepared,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token,
            )
        except _TemplateRaised as exc:
            raise InvalidRequestError(str(exc)) from exc
        except (jinja2.TemplateError, TypeError) as exc:
            raise InvalidRequestError(f"chat template failed to render the messages: {exc}") from exc


class _TemplateRaised(Exception):
    """Raised by a chat template's ``raise_exception(message)`` call."""


def _raise_from_template(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    # Same environment options as HF transformers, so templates written for it render identically.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_from_template
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: {exc} (line {exc.lineno})") from exc


def _prepare_messages(messages: list[dict]) -> list[dict]:
    """Copies of ``messages`` whose ``content`` is a plain string (OpenAI text parts joined)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{index}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{index}].role must be a non-empty string")
        copy = dict(message)
        copy["content"] = _content_text(message.get("content"), index)
        prepared.append(copy)
    return prepared


def _content_text(content: Any, index: int) -> str:
    if content is None:
        # Assistant messages that only carry tool calls have no content.
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}"
        )
    texts = []
    for part_index, part in enumerate(content):
        if not isinstance(part, dict):
            raise InvalidRequestError(f"messages[{index}].content[{part_index}] must be an object")
        part_type = part.get("type")
        if part_type != "text":
            raise InvalidRequestError(
                f"messages[{index}].content[{part_index}] has type {part_type!r}; only 'text' parts are supported"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"messages[{index}].content[{part_index}].text must be a string")
        texts.append(text)
    # Same joining rule as vLLM's "string" content format: parts become lines.
    return "\n".join(texts)


# ---------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_path: str) -> Tokenizer:
    """Load the tokenizer of a ``.gguf`` file or a Hugging Face model directory."""
    if os.path.isdir(model_path):
        return _load_hf_directory(model_path)
    if os.path.isfile(model_path) and model_path.lower().endswith(".gguf"):
        return _load_gguf(model_path)
    raise ValueError(f"cannot load a tokenizer from {model_path!r}: expected a .gguf file or a model directory")


def _load_gguf(path: str) -> Tokenizer:
    import gguf  # imported here: only GGUF models need it

    reader = gguf.GGUFReader(path, "r")

    def field(name: str, default: Any = None) -> Any:
        found = reader.get_field(name)
        return default if found is None else found.contents()

    tokenizer_model = field("tokenizer.ggml.model")
    if tokenizer_model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {tokenizer_model!r} in {path}: only byte-level BPE ('gpt2') is supported"
        )
    tokens: list[str] = field("tokenizer.ggml.tokens")
    merges: list[str] = field("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise ValueError(f"{path} has no tokenizer.ggml.tokens/merges: cannot build a BPE tokenizer")
    token_types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre_type = field("tokenizer.ggml.pre", "default")
    add_prefix_space = bool(field("tokenizer.ggml.add_space_prefix", False))
    add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
    bos_id = field("tokenizer.ggml.bos_token_id")
    eos_ids = [field(key) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id")]
    backend = build_byte_level_bpe(tokens, merges, token_types, pre_type, add_prefix_space,
                                   bos_token_id=bos_id if add_bos else None)
    return Tokenizer(
        backend,
        bos_token_id=None if bos_id is None else int(bos_id),
        eos_token_ids=_unique_ids(eos_ids),
        chat_template=field("tokenizer.chat_template"),
    )


def build_byte_level_bpe(
    tokens: list[str],
    merges: list[str],
    token_types: list[int],
    pre_type: str,
    add_prefix_space: bool = False,
    bos_token_id: int | None = None,
) -> HFTokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from llama.cpp's vocabulary arrays.

    ``bos_token_id`` set: ``encode(..., add_special_tokens=True)`` prepends it.
    """
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merge_pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed BPE merge {merge!r} (expected 'left right')")
        # tokenizers panics (an uncatchable-looking PanicException) on merges outside the vocabulary.
        if left not in vocab or right not in vocab or left + right not in vocab:
            raise ValueError(f"BPE merge {merge!r} uses or produces a token missing from the vocabulary")
        merge_pairs.append((left, right))
    # llama-bpe (Llama 3) looks whole words up in the vocabulary before merging, like HF does.
    backend = HFTokenizer(models.BPE(vocab, merge_pairs, ignore_merges=pre_type == "llama-bpe"))
    backend.pre_tokenizer = _pre_tokenizer(pre_type, add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    if bos_token_id is None:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos = tokens[bos_token_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
        )
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_CONTROL]
    user_defined = [AddedToken(tokens[i], special=False, normalized=False)
                    for i, kind in enumerate(token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)
    return backend


def _pre_tokenizer(pre_type: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    if pre_type == "smollm":
        # llama.cpp's smollm type: every digit its own word, then the GPT-2 split.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
        ])
    if pre_type in ("llama-bpe", "qwen2"):
        pattern = _LLAMA3_PATTERN if pre_type == "llama-bpe" else _QWEN2_PATTERN
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    if pre_type not in ("default", "gpt2", "gpt-2"):
        logger.warning("GGUF pre-tokenizer %r is not implemented; using the GPT-2 split, "
                       "so some texts may tokenize differently from llama.cpp", pre_type)
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _load_hf_directory(directory: str) -> Tokenizer:
    tokenizer_file = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ValueError(f"{directory} has no tokenizer.json (only fast-tokenizer directories are supported)")
    backend = HFTokenizer.from_file(tokenizer_file)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    generation_config = _read_json(os.path.join(directory, "generation_config.json"))

    added = config.get("added_tokens_decoder") or {}
    specials = [AddedToken(entry["content"], special=True, normalized=bool(entry.get("normalized", False)))
                for entry in added.values() if entry.get("special")]
    if specials:
        backend.add_special_tokens(specials)

    bos_id = _token_id_of(backend, config.get("bos_token"), "bos_token")
    eos_ids = [_token_id_of(backend, config.get("eos_token"), "eos_token")]
    generation_eos = generation_config.get("eos_token_id")
    eos_ids.extend(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    unique_eos = _unique_ids(eos_ids)
    if not unique_eos:
        raise ValueError(f"{directory}: no eos token in tokenizer_config.json or generation_config.json")
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=unique_eos,
                     chat_template=_hf_chat_template(directory, config))


def _hf_chat_template(directory: str, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one called "default" is what a plain chat uses.
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if template is None:
        # Newer transformers versions save the template beside the config instead of inside it.
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as handle:
                template = handle.read()
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{directory}: chat_template must be a string, got {type(template).__name__}")
    return template


def _token_id_of(backend: HFTokenizer, token: Any, what: str) -> int | None:
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    if not isinstance(token, str):
        raise ValueError(f"tokenizer_config.json {what} must be a string or an object with 'content'")
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"tokenizer_config.json {what} {token!r} is not in the vocabulary")
    return token_id


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must contain a JSON object")
    return data


def _unique_ids(ids: list[Any]) -> tuple[int, ...]:
    """Ids in first-seen order, without None or duplicates."""
    seen: dict[int, None] = {}
    for token_id in ids:
        if token_id is not None:
            seen.setdefault(int(token_id), None)
    return tuple(seen)
