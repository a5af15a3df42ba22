"""The OpenAI wire protocol of the API server: request models, response builders, error bodies.

Owns: parsing and validating ``/v1/completions`` and ``/v1/chat/completions`` request bodies
(pydantic v2, strict types: a value of the wrong JSON type is a 400, never silently coerced),
turning a valid request into ``SamplingParams``, and building the JSON of responses, stream
chunks, usage and errors. Pure functions and models only: no I/O, no tokenizer, no engine.

Nothing silently ignored: every field of OpenAI's request schemas and of vLLM's extensions is
declared. Each is honoured, refused with a 400 naming it unless it has its neutral value
(``COMPLETION_REFUSALS`` / ``CHAT_REFUSALS``, range checks in ``check_supported``), accepted
as bookkeeping that cannot change the output (user, metadata, ...), or handed to the serving
layer (structured output and tools). Keys no schema has are ignored, as OpenAI clients send
extras, and logged once per name.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

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

# logprobs / top_logprobs / prompt_logprobs cap (vLLM's default max_logprobs; OpenAI's chat cap).
MAX_LOGPROBS = 20
# Choices per request (each choice is one running sequence in the engine).
MAX_N = 128
# Prompts in one batched /v1/completions request (each is one engine request).
MAX_BATCH_PROMPTS = 256
# repetition_penalty divides positive logits and multiplies negative ones: far outside this range a
# float32 logit overflows (found by the fuzz test: 4.7e-219 made them inf). Useful values are ~1..2.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# The completion budget of /v1/completions when the request names none (OpenAI's default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Roles a chat message may have (OpenAI's, "function" being the deprecated form of "tool").
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Unknown request keys already logged (each name once per process: clients repeat them on every request).
# Bounded: a client inventing new names on every request must not grow it (nor the log) without end.
_logged_unknown_fields: set[str] = set()
_MAX_LOGGED_UNKNOWN_FIELDS = 256


def _is_none(value: Any) -> bool:
    return value is None


def _is_falsy(value: Any) -> bool:
    return not value


def _equals(default: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value == default


@dataclass(frozen=True)
class Refusal:
    """A request field fdserve does not implement: accepted only while ``neutral(value)`` holds,
    otherwise a 400 naming the field with ``reason``."""

    field: str
    neutral: Callable[[Any], bool]
    reason: str


# Fields of both endpoints that are refused unless neutral (the README's field table lists them).
COMMON_REFUSALS: tuple[Refusal, ...] = (
    Refusal("use_beam_search", _is_falsy, "beam search is not supported"),
    Refusal("length_penalty", _equals(1.0), "length_penalty only applies to beam search, which is not supported"),
    Refusal("spaces_between_special_tokens", _equals(True),
            "spaces_between_special_tokens=false is not supported"),
    Refusal("allowed_token_ids", _is_none, "allowed_token_ids is not supported"),
    Refusal("priority", _equals(0), "priority scheduling is not supported (only priority 0)"),
    Refusal("logits_processors", _is_falsy, "custom logits_processors are not supported"),
    Refusal("cache_salt", _is_none, "cache_salt (per-user prefix cache isolation) is not supported"),
    Refusal("vllm_xargs", _is_falsy, "vllm_xargs (custom extension arguments) are not supported"),
)

COMPLETION_REFUSALS: tuple[Refusal, ...] = COMMON_REFUSALS + (
    Refusal("suffix", _is_falsy, "suffix (fill-in-the-middle) is not supported"),
    Refusal("prompt_embeds", _is_none, "prompt_embeds are not supported"),
    Refusal("max_completion_tokens", _is_none,
            "max_completion_tokens is a chat completions field; /v1/completions takes max_tokens"),
)

CHAT_REFUSALS: tuple[Refusal, ...] = COMMON_REFUSALS + (
    Refusal("audio", _is_none, "audio output is not supported"),
    Refusal("modalities", lambda value: value is None or list(value) == ["text"],
            "only the text modality is supported"),
    Refusal("prediction", _is_none, "predicted outputs (prediction) are not supported"),
    Refusal("web_search_options", _is_none, "web search is not supported"),
    Refusal("reasoning_effort", _is_none, "reasoning_effort is not supported: the model does not reason"),
    Refusal("verbosity", _is_none, "verbosity is not supported"),
    Refusal("echo", _is_falsy, "echo is not supported on chat completions"),
    Refusal("continue_final_message", _is_falsy, "continue_final_message is not supported"),
    Refusal("documents", _is_none, "documents are not supported"),
    Refusal("chat_template", _is_none, "a per-request chat_template is not supported"),
    Refusal("chat_template_kwargs", _is_falsy, "chat_template_kwargs are not supported"),
    Refusal("mm_processor_kwargs", _is_falsy, "mm_processor_kwargs are not supported (text-only model)"),
)

# Structured output and tool fields are declared on the request models and decided in serving
# (``_structured_output_spec``, ``_tool_call_spec``). Bookkeeping fields that cannot change the output
# (user, metadata, store, service_tier, prompt_cache_key, safety_identifier, request_id,
# include_reasoning) are declared and accepted as they are.


class _StrictModel(BaseModel):
    # strict: "5" is not an int and 1 is not a bool; allow_inf_nan=False: NaN/1e400 are not temperatures.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_StrictModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # extension (vLLM)
    include_obfuscation: bool | None = None  # OpenAI: padding against side channels; no effect on content


class GenerationRequest(_StrictModel):
    """Fields shared by completions and chat completions.

    Every field of OpenAI's request schemas and of vLLM's extensions is declared: it is honoured, or
    refused with a 400 naming it unless it has its neutral value (``check_supported``). Keys that are
    not declared are ignored (OpenAI clients send extras) and logged once per name.
    """

    # extra="allow": undeclared keys land in model_extra, so they can be logged (then ignored).
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    REFUSALS: ClassVar[tuple[Refusal, ...]] = COMMON_REFUSALS

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM, FastDeploy)
    min_p: float | None = None  # extension (vLLM)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    include_stop_str_in_output: bool | None = False  # extension (vLLM)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    min_tokens: int | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None  # extension (vLLM)
    prompt_logprobs: int | None = None  # extension (vLLM)
    return_tokens_as_token_ids: bool | None = None  # extension (vLLM)
    ignore_eos: bool | None = False  # extension
    return_token_ids: bool | None = False  # extension (FastDeploy, vLLM)
    skip_special_tokens: bool | None = True  # extension (vLLM)
    spaces_between_special_tokens: bool | None = True  # extension (vLLM)
    truncate_prompt_tokens: int | None = None  # extension (vLLM): keep only the last k prompt tokens
    add_special_tokens: bool | None = None  # extension (vLLM); default per endpoint
    # Refused unless neutral (COMMON_REFUSALS).
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    allowed_token_ids: list[int] | None = None
    priority: int | None = 0
    logits_processors: Any = None
    cache_salt: str | None = None
    # Honoured: P/D disaggregation (vLLM's name; engine/disaggregation.py). The engine of a prefill or decode
    # instance acts on it; a mixed instance serves the request whole (the output is the same by construction).
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: Any = None
    # Structured output (decided in serving._structured_output_spec).
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structural_tag: Any = None
    structured_outputs: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    # Accepted without effect on the output.
    user: str | None = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    request_id: Any = None

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
            parsed = cls.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error_to_api_error(exc) from None
        parsed._log_unknown_fields()
        return parsed

    def _log_unknown_fields(self) -> None:
        for name in self.model_extra or {}:
            if name not in _logged_unknown_fields and len(_logged_unknown_fields) < _MAX_LOGGED_UNKNOWN_FIELDS:
                _logged_unknown_fields.add(name)
                logger.warning("ignoring the unknown request field %r (logged once)", name[:100])

    # -- checks and derived values

    def check_supported(self) -> None:
        """Every field is honoured or refused here: a 400 naming a field set to a value this server
        does not implement (never silently ignored), or out of its range."""
        for refusal in self.REFUSALS:
            if not refusal.neutral(getattr(self, refusal.field)):
                raise APIError(refusal.reason, param=refusal.field)
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:
            raise APIError("stream_options.continuous_usage_stats needs stream_options.include_usage",
                           param="stream_options")
        n = self.num_choices
        if not 1 <= n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {n}", param="n")
        if self.best_of is not None and self.best_of != n:
            raise APIError(f"best_of={self.best_of} is not supported: only best_of equal to n ({n}) or absent "
                           "(no server-side ranking of choices)", param="best_of")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise APIError(f"{name} must be in [-2, 2], got {value}", param=name)
        if self.repetition_penalty is not None and not (MIN_REPETITION_PENALTY <= self.repetition_penalty
                                                        <= MAX_REPETITION_PENALTY):
            raise APIError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], "
                           f"got {self.repetition_penalty}", param="repetition_penalty")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise APIError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise APIError(f"min_tokens must be >= 0, got {self.min_tokens}", param="min_tokens")
        _check_logprobs_count("prompt_logprobs", self.prompt_logprobs)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise APIError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}",
                           param="truncate_prompt_tokens")
        self.logit_bias_ids()  # raises for keys that are not integers or values out of range
        if self.stop_strings and any(not stop for stop in self.stop_strings):
            raise APIError("stop strings must not be empty", param="stop")
        if self.bad_words is not None and any(not word for word in self.bad_words):
            raise APIError("bad_words entries must not be empty", param="bad_words")

    def check_model(self, served_model_name: str) -> None:
        """404 ``model_not_found`` for a model this server does not serve (as OpenAI and vLLM answer)."""
        if self.model and self.model != served_model_name:
            raise APIError(f"The model '{self.model}' does not exist; this server serves '{served_model_name}'",
                           status_code=404, param="model", code="model_not_found")

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

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

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats`` (with ``include_usage``): usage so far on every chunk."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def logprobs_count(self) -> int | None:
        """k of the sampled tokens' logprobs (chosen token + top k), None when not asked for."""
        return None

    @property
    def echo_prompt(self) -> bool:
        return False

    def logit_bias_ids(self, vocab_size: int | None = None) -> dict[int, float]:
        """``logit_bias`` with integer token ids; 400 for a key that is not a token id (or, given the
        vocabulary size, outside it) or a bias outside [-100, 100]."""
        biases: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key.strip())
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids written as integers, got {key!r}",
                               param="logit_bias") from None
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                limit = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
                raise APIError(f"logit_bias key {key!r} is not a token id of this model: ids must be {limit}",
                               param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise APIError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}",
                               param="logit_bias")
            biases[token_id] = float(bias)
        return biases

    def to_sampling_params(self, max_tokens: int, vocab_size: int | None = None) -> SamplingParams:
        """Sampling parameters with OpenAI defaults, validated; raises ``APIError`` (400).

        ``bad_words_token_ids`` and ``structured_output`` are filled in by the serving layer (they need
        the tokenizer). ``max_tokens`` is the client's budget; 0 (echo only) becomes 1 for the engine.
        """
        if self.min_tokens is not None and self.min_tokens > max_tokens >= 0:
            raise APIError(f"min_tokens ({self.min_tokens}) must not exceed {self.max_tokens_param} ({max_tokens})",
                           param="min_tokens")
        if max_tokens == 0 and self.echo_prompt:
            # Echo alone: the engine runs the prefill (for the prompt's logprobs) and one step whose
            # token the serving layer drops, as vLLM does.
            max_tokens = 1
        prompt_logprobs = self.prompt_logprobs
        if self.echo_prompt and self.logprobs_count is not None:
            # echo + logprobs shows the prompt's logprobs too: ask the engine for at least as many.
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs_count)
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=self.stop_strings,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens or 0,
            min_p=self.min_p or 0.0,
            logit_bias=self.logit_bias_ids(vocab_size),
            logprobs=self.logprobs_count,
            prompt_logprobs=prompt_logprobs,
            n=self.num_choices,
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
        if field == "logprobs":
            return self._logprobs_param
        if field == "bad_words_token_ids":
            return "bad_words"
        return field if field in SamplingParams.__dataclass_fields__ else None

    @property
    def _logprobs_param(self) -> str:
        return "logprobs"


def _check_logprobs_count(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)


PromptInput = str | list[int]


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    REFUSALS: ClassVar[tuple[Refusal, ...]] = COMPLETION_REFUSALS

    # Accepted on the wire: str | [str] | list[int] | [list[int]]; normalised by _check_prompt to a
    # non-empty list of prompts, each a text or a list of token ids.
    prompt: list[PromptInput]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None
    max_completion_tokens: int | None = None  # a chat field: refused here (COMPLETION_REFUSALS)

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[PromptInput]:
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be an empty string")
            return [value]
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id "
                             "lists (and not empty)")
        if all(_is_int(item) for item in value):
            return [list(value)]
        if len(value) > MAX_BATCH_PROMPTS:
            raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(value)}")
        if all(isinstance(item, str) for item in value):
            if any(not item for item in value):
                raise ValueError("a prompt in the list is an empty string")
            return list(value)
        if all(isinstance(item, list) for item in value):
            for item in value:
                if not item or not all(_is_int(token) for token in item):
                    raise ValueError("each token-id list must be a non-empty list of integers")
            return [list(item) for item in value]
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists "
                         "(not a mix)")

    @property
    def prompts(self) -> list[PromptInput]:
        return self.prompt

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def echo_prompt(self) -> bool:
        return bool(self.echo)

    def check_supported(self) -> None:
        super().check_supported()
        _check_logprobs_count("logprobs", self.logprobs)
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens=0 is only allowed with echo=true (the answer is then the prompt alone)",
                           param="max_tokens")


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id, ...) reach the chat template unchanged; the
    # tokenizer validates ``content`` (string, None or text parts) with precise messages.
    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: Any = None

    @model_validator(mode="after")
    def _check_role_and_content(self) -> "ChatMessage":
        if self.role not in CHAT_ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {', '.join(CHAT_ROLES)}")
        if self.content is None:
            extra = self.model_extra or {}
            if not (self.role == "assistant" and (extra.get("tool_calls") or extra.get("function_call"))):
                raise ValueError(f"a {self.role} message needs content (only an assistant message with "
                                 "tool_calls may omit it)")
        return self


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    REFUSALS: ClassVar[tuple[Refusal, ...]] = CHAT_REFUSALS

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True  # extension (vLLM)
    # Tools (decided in serving._tool_call_spec).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    include_reasoning: bool | None = True  # extension (vLLM): no reasoning parser here, so no effect
    # Refused unless neutral (CHAT_REFUSALS).
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    echo: bool | None = False
    continue_final_message: bool | None = False
    documents: Any = None
    chat_template: str | None = None
    chat_template_kwargs: Any = None
    mm_processor_kwargs: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def logprobs_count(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    @property
    def _logprobs_param(self) -> str:
        return "top_logprobs"

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError("messages must be a non-empty list", param="messages")
        _check_logprobs_count("top_logprobs", self.top_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")

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


def _with_extras(choice: dict[str, Any], prompt_token_ids: list[int] | None,
                 completion_token_ids: list[int] | None, prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
    # Extensions appear only when asked for: a plain OpenAI response has none of these keys.
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if completion_token_ids is not None:
        choice["completion_token_ids"] = completion_token_ids
    return choice


def completion_choice(index: int, text: str, finish_reason: str | None, *, logprobs: dict[str, Any] | None = None,
                      prompt_token_ids: list[int] | None = None, completion_token_ids: list[int] | None = None,
                      prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
    """One ``/v1/completions`` choice (of a response or of a stream chunk)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _with_extras(choice, prompt_token_ids, completion_token_ids, prompt_logprobs)


def chat_choice(index: int, content: str, finish_reason: str | None, *, logprobs: dict[str, Any] | None = None,
                prompt_token_ids: list[int] | None = None,
                completion_token_ids: list[int] | None = None) -> dict[str, Any]:
    """One ``/v1/chat/completions`` choice of a non-streamed response."""
    choice = {"index": index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
              "finish_reason": finish_reason}
    return _with_extras(choice, prompt_token_ids, completion_token_ids)


def chat_delta_choice(index: int, content: str | None, finish_reason: str | None = None, *, role: str | None = None,
                      logprobs: dict[str, Any] | None = None, prompt_token_ids: list[int] | None = None,
                      completion_token_ids: list[int] | None = None) -> dict[str, Any]:
    """One choice of a chat stream chunk; ``role`` only in a choice's first chunk."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _with_extras(choice, prompt_token_ids, completion_token_ids)


def completion_response(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage_: dict[str, Any]) -> dict[str, Any]:
    """Body of a non-streamed ``/v1/completions`` answer."""
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_completion_response(request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                             usage_: dict[str, Any], prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
    """Body of a non-streamed ``/v1/chat/completions`` answer (vLLM puts ``prompt_logprobs`` at the top)."""
    body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body


def completion_chunk(request_id: str, created: int, model: str, choice: dict[str, Any],
                     with_usage_field: bool = False) -> dict[str, Any]:
    """One streamed ``/v1/completions`` event holding one choice (``completion_choice``)."""
    return _stream_chunk("text_completion", request_id, created, model, choice, with_usage_field)


def chat_completion_chunk(request_id: str, created: int, model: str, choice: dict[str, Any],
                          with_usage_field: bool = False, prompt_logprobs: list[Any] | None = None) -> dict[str, Any]:
    """One streamed ``/v1/chat/completions`` event holding one choice (``chat_delta_choice``)."""
    chunk = _stream_chunk("chat.completion.chunk", request_id, created, model, choice, with_usage_field)
    if prompt_logprobs is not None:
        chunk["prompt_logprobs"] = prompt_logprobs
    return chunk


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
