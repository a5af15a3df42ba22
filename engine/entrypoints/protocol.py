"""The OpenAI wire protocol of the API server: request models, response builders, error bodies.

Owns: parsing and validating ``/v1/completions`` and ``/v1/chat/completions`` request bodies
(pydantic v2, strict types: a value of the wrong JSON type is a 400, never silently coerced;
unknown fields are ignored because OpenAI clients send extras), turning a valid request into
``SamplingParams``, and building the JSON of responses, stream chunks, usage and errors.
Pure functions and models only: no I/O, no tokenizer, no engine.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from config.sampling_params import InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
SSE_DONE = b"data: [DONE]\n\n"


class APIError(Exception):
    """An error the server answers with the OpenAI error body and ``status_code``."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 code: str | None = None, error_type: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, error_type=self.error_type, param=self.param, code=self.code)


def error_body(message: str, *, error_type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI sends it."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------------
# Requests


class _StrictModel(BaseModel):
    # strict: "5" is not an int and 1 is not a bool; allow_inf_nan=False: NaN/1e400 are not temperatures.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_StrictModel):
    include_usage: bool | None = None


class GenerationRequest(_StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, FastDeploy)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool | None = False  # extension
    return_token_ids: bool | None = False  # extension (FastDeploy)
    skip_special_tokens: bool | None = True  # extension (vLLM)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="plain")
    @classmethod
    def _check_stop(cls, value: Any) -> str | list[str] | None:
        # A plain validator: one readable message instead of one error per union branch.
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return value
        raise ValueError("must be a string or a list of strings")

    @classmethod
    def parse(cls, body: bytes) -> "GenerationRequest":
        """Validate a raw JSON body; raises ``APIError`` (400) for bad JSON, types or shapes."""
        try:
            return cls.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error_to_api_error(exc) from None

    # -- checks and derived values

    def check_supported(self) -> None:
        """Reject OpenAI features this server does not implement (400, never silently ignored)."""
        if self.n is not None and self.n != 1:
            raise APIError(f"n={self.n} is not supported: only one choice per request (n=1)", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and value != 0:
                raise APIError(f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.stop_strings and any(not stop for stop in self.stop_strings):
            raise APIError("stop strings must not be empty", param="stop")

    def check_model(self, served_model_name: str) -> None:
        if self.model and self.model != served_model_name:
            raise APIError(f"The model '{self.model}' does not exist; this server serves '{served_model_name}'",
                           param="model", code="model_not_found")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The request field that set the completion budget (for error messages)."""
        return "max_tokens"

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """Sampling parameters with OpenAI defaults, validated; raises ``APIError`` (400)."""
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop_strings,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
        )
        try:
            params.validate()
        except InvalidRequestError as exc:
            raise APIError(str(exc), param=self._param_of_sampling_error(str(exc))) from None
        return params

    def _param_of_sampling_error(self, message: str) -> str | None:
        # SamplingParams messages start with the field name ("top_p must be in ..."); name the
        # request field so the error body's ``param`` points at what the client sent.
        field = message.split(" ", 1)[0]
        if field == "max_tokens":
            return self.max_tokens_param
        return field if field in SamplingParams.__dataclass_fields__ else None


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    # Accepted on the wire: str | [str] | list[int] | [list[int]]; normalised by _check_prompt.
    prompt: str | list[int]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool | None = True  # extension (vLLM): let the tokenizer add BOS if the model wants it

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[int]:
        # Normalised to one text or one list of token ids (batches of one are unwrapped).
        if isinstance(value, str):
            return value
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
            if isinstance(value, str):
                return value
        if isinstance(value, list) and value and all(_is_int(item) for item in value):
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(item, (str, list)) for item in value):
            raise ValueError("batched prompts are not supported: send one prompt per request")
        raise ValueError("must be a string, a non-empty list of token ids, or a list holding exactly one of those")

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError("echo is not supported", param="echo")
        if self.logprobs:
            raise APIError("logprobs are not supported", param="logprobs")
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != 1:
            raise APIError("best_of is not supported (only 1)", param="best_of")


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) reach the chat template unchanged; the
    # tokenizer validates ``content`` (string, None or text parts) with precise messages.
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: Any = None


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True  # extension (vLLM)

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError("messages must be a non-empty list", param="messages")
        if self.logprobs or self.top_logprobs:
            raise APIError("logprobs are not supported", param="logprobs" if self.logprobs else "top_logprobs")

    def message_dicts(self) -> list[dict[str, Any]]:
        return [message.model_dump() for message in self.messages]


def _is_int(value: Any) -> bool:
    # bool is an int subclass in Python; JSON true is not a token id.
    return isinstance(value, int) and not isinstance(value, bool)


def validation_error_to_api_error(exc: ValidationError) -> APIError:
    """A readable 400 from pydantic's errors: ``field: problem`` per field, the first field as ``param``."""
    errors = exc.errors(include_url=False)
    if any(error["type"] == "json_invalid" for error in errors):
        return APIError(f"The request body is not valid JSON: {errors[0]['msg']}", code="invalid_json")
    messages: list[str] = []
    params: list[str] = []
    for error in errors:
        loc = ".".join(str(part) for part in error["loc"])
        if error["type"] == "value_error" and "error" in error.get("ctx", {}):
            text = str(error["ctx"]["error"])
        elif error["type"] == "model_type" and not error["loc"]:
            text = "the request body must be a JSON object"
        else:
            text = error["msg"]
        if error["loc"]:
            params.append(str(error["loc"][0]))
        message = f"{loc}: {text}" if loc else text
        if message not in messages:
            messages.append(message)
    return APIError("; ".join(messages), param=params[0] if params else None)


# ---------------------------------------------------------------------------------------------
# Responses


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _with_token_ids(choice: dict[str, Any], prompt_token_ids: list[int] | None,
                    completion_token_ids: list[int] | None) -> dict[str, Any]:
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if completion_token_ids is not None:
        choice["completion_token_ids"] = completion_token_ids
    return choice


def completion_response(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                        usage_: dict[str, Any], prompt_token_ids: list[int] | None = None,
                        completion_token_ids: list[int] | None = None) -> dict[str, Any]:
    """Body of a non-streamed ``/v1/completions`` answer."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_with_token_ids(choice, prompt_token_ids, completion_token_ids)],
        "usage": usage_,
    }


def chat_completion_response(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                             usage_: dict[str, Any], prompt_token_ids: list[int] | None = None,
                             completion_token_ids: list[int] | None = None) -> dict[str, Any]:
    """Body of a non-streamed ``/v1/chat/completions`` answer."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_with_token_ids(choice, prompt_token_ids, completion_token_ids)],
        "usage": usage_,
    }


def completion_chunk(request_id: str, created: int, model: str, text: str, finish_reason: str | None = None,
                     prompt_token_ids: list[int] | None = None, completion_token_ids: list[int] | None = None,
                     with_usage_field: bool = False) -> dict[str, Any]:
    """One streamed ``/v1/completions`` event."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _stream_chunk("text_completion", request_id, created, model,
                         _with_token_ids(choice, prompt_token_ids, completion_token_ids), with_usage_field)


def chat_completion_chunk(request_id: str, created: int, model: str, content: str | None,
                          finish_reason: str | None = None, role: str | None = None,
                          prompt_token_ids: list[int] | None = None, completion_token_ids: list[int] | None = None,
                          with_usage_field: bool = False) -> dict[str, Any]:
    """One streamed ``/v1/chat/completions`` event; ``role`` only in the first one."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _stream_chunk("chat.completion.chunk", request_id, created, model,
                         _with_token_ids(choice, prompt_token_ids, completion_token_ids), with_usage_field)


def _stream_chunk(object_type: str, request_id: str, created: int, model: str, choice: dict[str, Any],
                  with_usage_field: bool) -> dict[str, Any]:
    chunk = {"id": request_id, "object": object_type, "created": created, "model": model, "choices": [choice]}
    if with_usage_field:
        # OpenAI sends "usage": null on every chunk but the last when include_usage is on.
        chunk["usage"] = None
    return chunk


def usage_chunk(object_type: str, request_id: str, created: int, model: str,
                usage_: dict[str, Any]) -> dict[str, Any]:
    """The last event of a stream with ``stream_options.include_usage``: usage, no choices."""
    return {"id": request_id, "object": object_type, "created": created, "model": model, "choices": [],
            "usage": usage_}


def model_list(served_model_name: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {"object": "list", "data": [model_card(served_model_name, max_model_len, created)]}


def model_card(served_model_name: str, max_model_len: int, created: int | None = None) -> dict[str, Any]:
    return {
        "id": served_model_name,
        "object": "model",
        "created": int(time.time()) if created is None else created,
        "owned_by": "fdserve",
        "max_model_len": max_model_len,
    }


def to_json(obj: Any) -> bytes:
    # Compact separators and raw UTF-8: this runs once per streamed chunk.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse_event(obj: Any) -> bytes:
    """One server-sent event line: ``data: {json}\\n\\n``."""
    return b"data: " + to_json(obj) + b"\n\n"
