"""Request fields that constrain the output -> one ``StructuredOutputSpec``, validated at the API server.

Owns the wire forms of structured output and their 400s. Accepted (document in the README):

- OpenAI ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``.
- FastDeploy / vLLM (<= 0.10) extensions, the primary form: ``guided_json`` (a schema object or its JSON
  text), ``guided_regex`` (a regular expression), ``guided_choice`` (a list of strings; the output is exactly
  one of them), ``guided_grammar`` (a Lark grammar in llguidance's dialect, or GBNF).
- vLLM's current ``structured_outputs`` object with exactly one of ``json``, ``regex``, ``choice``, ``grammar``
  (same meanings) or ``json_object: true``.

At most one of these may constrain a request (``response_format`` type ``text`` does not count); two are
a 400 naming both. Every spec is compiled once here with llguidance (no tokenizer needed) so that a bad
schema, regex or grammar is a 400 carrying the compiler's message, not an error after a 200; with the
server's tokenizer (built for llguidance once, on the first constrained request) the check also covers
what depends on the vocabulary, such as a grammar naming a special token the model lacks.
"""
from __future__ import annotations

import json
import logging
import threading
import weakref
from typing import Any, Mapping

from llguidance import LLTokenizer

from config.sampling_params import InvalidRequestError
from config.structured_output import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, StructuredOutputSpec
from engine.structured_output import StructuredOutputError, ll_tokenizer_from, validate_spec

logger = logging.getLogger(__name__)

# llguidance tokenizers of the API server's tokenizers (one in practice), dropped with their tokenizer.
_LL_TOKENIZERS: "weakref.WeakKeyDictionary[Any, LLTokenizer]" = weakref.WeakKeyDictionary()
_LL_TOKENIZERS_LOCK = threading.Lock()

# The request fields this module reads (the API server must treat them as handled, not unknown).
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
FIELDS = ("response_format", *GUIDED_FIELDS, "structured_outputs")
# Keys of vLLM's ``structured_outputs`` object we honour; its other keys are a 400 naming them.
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredRequestError(InvalidRequestError):
    """A 400 about a structured-output field; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_tokenizer(tokenizer: Any) -> LLTokenizer:
    """llguidance's view of the API server's tokenizer (``engine.tokenizer.Tokenizer``), built once (~0.2 s).

    Validation with it also catches what only the vocabulary decides (a grammar naming a special token
    the model does not have, a token id out of range).
    """
    with _LL_TOKENIZERS_LOCK:
        cached = _LL_TOKENIZERS.get(tokenizer)
        if cached is None:
            cached = ll_tokenizer_from(tokenizer.backend, tokenizer.eos_token_ids, tokenizer.vocab_size)
            _LL_TOKENIZERS[tokenizer] = cached
        return cached


def spec_from_request(fields: Mapping[str, Any], *, validate: bool = True,
                      tokenizer: Any = None) -> StructuredOutputSpec | None:
    """The spec asked for by ``fields`` (a request's values of ``FIELDS``; missing = None), or None.

    Raises ``StructuredRequestError`` (400) for malformed fields, for more than one constraint, and
    (``validate``) for a schema/regex/grammar that llguidance does not compile (against ``tokenizer``'s
    vocabulary when given, see ``grammar_tokenizer``).
    """
    # (label for messages, request field for ``param``, spec)
    found: list[tuple[str, str, StructuredOutputSpec]] = []
    response_format = fields.get("response_format")
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append((f"response_format ({response_format.get('type')})", "response_format", spec))
    for name in GUIDED_FIELDS:
        value = fields.get(name)
        if value is not None:
            found.append((name, name, _from_guided(name, value)))
    structured = fields.get("structured_outputs")
    if structured is not None:
        spec, label = _from_structured_outputs(structured)
        if spec is not None:
            found.append((label, "structured_outputs", spec))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(label for label, _, _ in found)
        raise StructuredRequestError(
            f"only one structured output constraint may be given per request, got {names}", param=found[1][1])
    label, param, spec = found[0]
    if validate:
        check_compiles(spec, label, param, None if tokenizer is None else grammar_tokenizer(tokenizer))
    return spec


def check_compiles(spec: StructuredOutputSpec, label: str, param: str, tokenizer: LLTokenizer | None = None) -> None:
    """400 with llguidance's message if ``spec`` does not compile; ``label`` names the field in the text."""
    try:
        validate_spec(spec, tokenizer)
    except StructuredOutputError as exc:
        raise StructuredRequestError(f"{label} does not compile: {exc}", param=param) from None


def json_schema_spec(schema: Any, label: str, param: str | None = None) -> StructuredOutputSpec:
    """A JSON_SCHEMA spec of a schema given as an object, a boolean or JSON text (400 otherwise).

    ``label`` names the value in messages, ``param`` the request field (default: ``label``).
    """
    param = param or label
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise StructuredRequestError(f"{label} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredRequestError(
            f"{label} must be a JSON schema (an object), got {type(schema).__name__}", param=param)
    # Key order is kept: llguidance generates an object's properties in the order the schema lists them.
    return StructuredOutputSpec(JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))


def _from_response_format(value: Any) -> StructuredOutputSpec | None:
    if not isinstance(value, Mapping):
        raise StructuredRequestError("response_format must be an object with a 'type'", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec(JSON_OBJECT)
    if kind == "json_schema":
        body = value.get("json_schema")
        if not isinstance(body, Mapping):
            raise StructuredRequestError(
                "response_format.json_schema must be an object with 'name' and 'schema'", param="response_format")
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise StructuredRequestError("response_format.json_schema.name must be a string", param="response_format")
        strict = body.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredRequestError("response_format.json_schema.strict must be a boolean",
                                         param="response_format")
        if "schema" not in body:
            raise StructuredRequestError("response_format.json_schema.schema is required", param="response_format")
        # ``strict`` needs no handling: the output is always decoded under the schema.
        return json_schema_spec(body["schema"], "response_format.json_schema.schema", "response_format")
    raise StructuredRequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format")


def _from_guided(name: str, value: Any) -> StructuredOutputSpec:
    if name == "guided_json":
        return json_schema_spec(value, name)
    if name == "guided_choice":
        return _choice_spec(value, name)
    kind = REGEX if name == "guided_regex" else GRAMMAR
    if not isinstance(value, str) or not value:
        raise StructuredRequestError(f"{name} must be a non-empty string", param=name)
    return StructuredOutputSpec(kind, value)


def _choice_spec(value: Any, label: str, param: str | None = None) -> StructuredOutputSpec:
    param = param or label
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise StructuredRequestError(f"{label} must be a non-empty list of strings", param=param)
    if any(not item for item in value):
        raise StructuredRequestError(f"{label} must not contain empty strings", param=param)
    return StructuredOutputSpec(CHOICE, json.dumps(value, ensure_ascii=False))


def _from_structured_outputs(value: Any) -> tuple[StructuredOutputSpec | None, str]:
    param = "structured_outputs"
    if not isinstance(value, Mapping):
        raise StructuredRequestError(
            f"structured_outputs must be an object with one of {', '.join(STRUCTURED_OUTPUTS_KEYS)}", param=param)
    unknown = [key for key, item in value.items() if key not in STRUCTURED_OUTPUTS_KEYS and item is not None]
    if unknown:
        raise StructuredRequestError(
            f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(STRUCTURED_OUTPUTS_KEYS)})",
            param=param)
    given = [key for key in STRUCTURED_OUTPUTS_KEYS if value.get(key) not in (None, False)]
    if not given:
        return None, param
    if len(given) > 1:
        raise StructuredRequestError(
            f"structured_outputs takes one constraint, got {', '.join(given)}", param=param)
    key = given[0]
    item = value[key]
    where = f"structured_outputs.{key}"
    if key == "json":
        return json_schema_spec(item, where, param), where
    if key == "choice":
        return _choice_spec(item, where, param), where
    if key == "json_object":
        if item is not True:
            raise StructuredRequestError(f"{where} must be a boolean", param=param)
        return StructuredOutputSpec(JSON_OBJECT), where
    if not isinstance(item, str) or not item:
        raise StructuredRequestError(f"{where} must be a non-empty string", param=param)
    return StructuredOutputSpec(REGEX if key == "regex" else GRAMMAR, item), where
