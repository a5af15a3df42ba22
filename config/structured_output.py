"""What a request asks its output to conform to (structured output), as the engine receives it.

One ``StructuredOutputSpec`` per request, built by the API server from ``response_format``,
the ``guided_*`` extensions or a tool-call schema, and compiled into a grammar by the engine
(``engine/structured_output.py``). Plain data: no grammar library is imported here.
"""
from __future__ import annotations

from dataclasses import dataclass

# Kinds of spec (``StructuredOutputSpec.kind``) and what ``value`` holds for each.
JSON_SCHEMA = "json_schema"  # value: the JSON schema, serialised as a JSON string
JSON_OBJECT = "json_object"  # value: "" (any JSON object)
REGEX = "regex"  # value: the regular expression
CHOICE = "choice"  # value: a JSON list of the allowed strings, serialised
GRAMMAR = "grammar"  # value: a Lark grammar
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, GRAMMAR)


@dataclass(frozen=True)
class StructuredOutputSpec:
    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; expected one of {KINDS}")
