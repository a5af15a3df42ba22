"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Owns: their request models and answers. They let a client count and build prompts with the
server's own tokenizer; evaluation harnesses use them instead of downloading the model's
tokenizer (lm-evaluation-harness's ``local-completions`` with ``tokenizer_backend=remote`` asks
``/tokenizer_info`` for the special tokens and chat template and ``/tokenize`` for token ids).
Shapes as vLLM answers: ``{"count", "max_model_len", "tokens", "token_strs"}`` and ``{"prompt"}``.
Like vLLM's, they sit outside ``/v1`` (the API key guards ``/v1/*`` only).
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError, model_validator

from engine.entrypoints.protocol import APIError, ChatMessage, _StrictModel, validation_error_to_api_error
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class TokenizeRequest(_StrictModel):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self


class DetokenizeRequest(_StrictModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


def _parse(model: type[_StrictModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from None


def _check_model(requested: str | None, served_model_name: str) -> None:
    if requested and requested != served_model_name:
        raise APIError(f"The model '{requested}' does not exist; this server serves '{served_model_name}'",
                       status_code=404, param="model", code="model_not_found")


def tokenize(tokenizer: Tokenizer, body: bytes, served_model_name: str, max_model_len: int) -> dict[str, Any]:
    """The answer of ``POST /tokenize``; ``APIError`` (400/404) for a bad request."""
    request = _parse(TokenizeRequest, body)
    _check_model(request.model, served_model_name)
    if request.messages is not None:
        try:
            text = tokenizer.apply_chat_template([m.model_dump() for m in request.messages],
                                                 add_generation_prompt=request.add_generation_prompt)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from None
        add_special = bool(request.add_special_tokens)
    else:
        text = request.prompt or ""
        add_special = request.add_special_tokens is not False
    tokens = tokenizer.encode(text, add_special)
    token_strs = [tokenizer.id_to_token(t) for t in tokens] if request.return_token_strs else None
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": token_strs}


def detokenize(tokenizer: Tokenizer, body: bytes, served_model_name: str) -> dict[str, Any]:
    """The answer of ``POST /detokenize``; ``APIError`` (400/404) for a bad request."""
    request = _parse(DetokenizeRequest, body)
    _check_model(request.model, served_model_name)
    vocab_size = tokenizer.vocab_size
    bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(f"token id {bad} in tokens is out of range: ids must be in [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(request.tokens, skip_special_tokens=False)}


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """The answer of ``GET /tokenizer_info``: special tokens, chat template, sizes."""
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None,
        "chat_template": tokenizer.chat_template,
        "model_max_length": max_model_len,
        "vocab_size": tokenizer.vocab_size,
    }
