"""Function calling for ``/v1/chat/completions``: tools in the prompt, tool calls out of the output.

Owns: validating ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and the tool messages of earlier
turns (400s name the field), rendering the prompt with tools, the JSON schema that ``required`` and a
named ``tool_choice`` are decoded under, parsing tool calls out of generated text (whole output and
streamed), and the OpenAI response shapes of tool calls.

Rendering: a chat template that mentions ``tools`` gets them as the ``tools`` variable (OpenAI's
``[{"type": "function", "function": {...}}]``), when the tokenizer can pass it. Otherwise (SmolLM2's
template does not take tools) the documented fallback: a system-prompt text (``fallback_tool_prompt``)
lists each tool as ``{"name", "description", "parameters"}`` and asks for the answer format
``{"name": "<tool>", "arguments": {...}}`` (a JSON list of those for parallel calls); earlier assistant
tool calls are rendered as that JSON, and ``role: "tool"`` results as user messages
``Result of <name> (call <id>): <content>`` (a template that does not take tools may not know the role).

``tool_choice``: ``none`` = tools are not rendered and nothing is parsed; ``auto`` = free generation, the
output is a tool call if it is the call JSON (bare, in ``<tool_call>`` tags, or in a fenced ```json
block) naming a known tool; ``required`` = decoded under a schema (a call object whose ``name`` is one
of the tools and whose ``arguments`` follow that tool's parameter schema; or, when
``parallel_tool_calls`` (the default), also a list of 1..8 such calls); named function = decoded under that function's parameter schema, the output
is its arguments (vLLM does the same). A parameter schema of type object that does not set
``additionalProperties`` is decoded with ``additionalProperties: false`` at its top level.
"""
from __future__ import annotations

import inspect
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from config.sampling_params import InvalidRequestError
from config.structured_output import JSON_SCHEMA, StructuredOutputSpec
from engine.entrypoints.structured_request import StructuredRequestError, check_compiles

logger = logging.getLogger(__name__)

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
MAX_PARALLEL_CALLS = 8  # bound on a decoded list of calls, so a small model cannot loop over ", {...}"
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_TOOL_CALL_TAGS = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCED = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?\s*```$", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict

    def decoding_schema(self) -> dict:
        """The parameter schema a call is decoded under: ``additionalProperties`` false at the top when the
        schema leaves it open (a small model otherwise invents arguments, as OpenAI's strict mode forbids)."""
        if self.parameters.get("type") == "object" and "additionalProperties" not in self.parameters:
            return {**self.parameters, "additionalProperties": False}
        return self.parameters

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request lists it (what chat templates that take tools expect)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """The validated tool fields of one chat request."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "function" (then ``function_name``)
    function_name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools are rendered and the output may be a tool call."""
        return bool(self.tools) and self.choice != "none"

    @property
    def constrained(self) -> bool:
        """The output is decoded under the tool-call schema (``required`` or a named function)."""
        return self.active and self.choice in ("required", "function")

    def tool(self, name: str) -> Tool | None:
        return next((tool for tool in self.tools if tool.name == name), None)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call = {"index": index, **call}
        return call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------------
# Request fields


def parse_tool_request(fields: Mapping[str, Any]) -> ToolRequest | None:
    """The validated ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; None when no tools are given.

    Raises ``StructuredRequestError`` (400, ``param`` names the field). Parameter schemas are compiled
    once with llguidance so a bad one is a 400 now rather than a failure after the 200.
    """
    raw_tools = fields.get("tools")
    tool_choice = fields.get("tool_choice")
    parallel = fields.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise StructuredRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if raw_tools is None or raw_tools == []:
        # "none" and "auto" without tools change nothing (there is nothing to call); clients send them.
        if tool_choice not in (None, "none", "auto"):
            raise StructuredRequestError("tool_choice 'required' or a named function needs tools",
                                         param="tool_choice")
        return None
    if not isinstance(raw_tools, list):
        raise StructuredRequestError("tools must be a list of function tools", param="tools")
    tools = tuple(_parse_tool(index, raw) for index, raw in enumerate(raw_tools))
    names = [tool.name for tool in tools]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise StructuredRequestError(f"tools: the function name {duplicate!r} is given twice", param="tools")
    choice, function_name = _parse_tool_choice(tool_choice, names)
    request = ToolRequest(tools=tools, choice=choice, function_name=function_name,
                          parallel=True if parallel is None else parallel)
    if request.active:
        for index, tool in enumerate(tools):
            check_compiles(StructuredOutputSpec(JSON_SCHEMA, json.dumps(tool.decoding_schema())),
                           f"tools[{index}].function.parameters", "tools")
    return request


def _parse_tool(index: int, raw: Any) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(raw, Mapping):
        raise StructuredRequestError(f"{where} must be an object", param="tools")
    if raw.get("type") != "function":
        raise StructuredRequestError(f"{where}.type must be 'function', got {raw.get('type')!r}", param="tools")
    function = raw.get("function")
    if not isinstance(function, Mapping):
        raise StructuredRequestError(f"{where}.function must be an object with a 'name'", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise StructuredRequestError(
            f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", param="tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise StructuredRequestError(f"{where}.function.description must be a string", param="tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS  # OpenAI: omitted parameters = a function without arguments
    if not isinstance(parameters, dict):
        raise StructuredRequestError(f"{where}.function.parameters must be a JSON schema object", param="tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredRequestError(f"{where}.function.strict must be a boolean", param="tools")
    return Tool(name=name, description=description or "", parameters=parameters)


def _parse_tool_choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if value in ("none", "auto", "required"):
        return value, None
    if isinstance(value, Mapping):
        function = value.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if value.get("type") != "function" or not isinstance(name, str):
            raise StructuredRequestError(
                "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                "\"function\": {\"name\": ...}}", param="tool_choice")
        if name not in names:
            raise StructuredRequestError(f"tool_choice names the function {name!r}, which is not in tools",
                                         param="tool_choice")
        return "function", name
    raise StructuredRequestError(
        f"tool_choice must be 'none', 'auto', 'required' or a named function, got {value!r}", param="tool_choice")


def tool_call_spec(request: ToolRequest) -> StructuredOutputSpec | None:
    """The spec ``required`` / a named function is decoded under (None for ``auto`` and ``none``)."""
    if not request.constrained:
        return None
    return StructuredOutputSpec(JSON_SCHEMA, json.dumps(tool_call_schema(request)))


def tool_call_schema(request: ToolRequest) -> dict[str, Any]:
    """JSON schema of a valid answer: the named function's arguments, or call object(s) over all tools."""
    if request.choice == "function":
        return request.tool(request.function_name).decoding_schema()
    # "name" first: llguidance keeps the schema's property order, and the function is chosen first.
    calls = [{
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.decoding_schema()},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for tool in request.tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if not request.parallel:
        return call
    # One call object (what the prompt shows first, so what a model writes most) or a list of calls.
    return {"anyOf": [call, {"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}]}


# ---------------------------------------------------------------------------------------------
# Prompt rendering


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template reads a ``tools`` variable and the tokenizer can pass one."""
    if not re.search(r"\btools\b", tokenizer.chat_template):
        return False
    return "tools" in inspect.signature(tokenizer.apply_chat_template).parameters


def render_chat(tokenizer: Any, messages: list[dict], request: ToolRequest | None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of ``messages`` with ``request``'s tools (template or fallback, see the module doc).

    Also the path for a conversation that carries earlier tool calls/results but no tools now.
    Raises ``InvalidRequestError`` (400) for malformed tool messages.
    """
    check_tool_messages(messages)
    tools_active = request is not None and request.active
    if template_takes_tools(tokenizer):
        if tools_active:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tools=[tool.openai() for tool in request.tools])
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    rendered = fallback_messages(messages)
    if tools_active:
        rendered = _with_system_text(rendered, fallback_tool_prompt(request))
    return tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt)


def fallback_tool_prompt(request: ToolRequest) -> str:
    """The system-prompt text that lists the tools and the exact answer format (the fallback)."""
    lines = ["You can call the following functions. Each is listed as JSON with its name, description "
             "and the JSON schema of its arguments:"]
    for tool in request.tools:
        lines.append(json.dumps({"name": tool.name, "description": tool.description,
                                 "parameters": tool.parameters}, ensure_ascii=False))
    lines.append("")
    lines.append('To call a function, answer with only this JSON and nothing else: '
                 '{"name": "<function name>", "arguments": {<the arguments as a JSON object>}}')
    if request.parallel:
        lines.append("To call several functions at once, answer with a JSON list of such objects.")
    if request.choice == "required":
        lines.append("You must call one of the functions.")
    elif request.choice == "function":
        lines.append(f'You must call the function "{request.function_name}"; answer with its arguments.')
    else:
        lines.append("If no function is needed, answer the user directly in plain text.")
    return "\n".join(lines)


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        content = first.get("content") or ""
        first["content"] = f"{content}\n\n{text}" if content else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def fallback_messages(messages: list[dict]) -> list[dict]:
    """``messages`` with assistant tool calls as call JSON and tool results as user messages."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant turns
    rendered = []
    for message in messages:
        role = message.get("role")
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            objects = []
            for call in calls:
                function = call["function"]
                names[call["id"]] = function["name"]
                objects.append({"name": function["name"], "arguments": _arguments_object(function["arguments"])})
            text = json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False)
            content = message.get("content")
            if isinstance(content, str) and content:
                text = f"{content}\n{text}"
            rendered.append({"role": "assistant", "content": text})
        elif role == "tool":
            call_id = message["tool_call_id"]
            name = names.get(call_id) or message.get("name") or "the function"
            rendered.append({"role": "user", "content": f"Result of {name} (call {call_id}): "
                                                        f"{_text_of(message.get('content'))}"})
        else:
            rendered.append(message)
    return rendered


def check_tool_messages(messages: list[dict]) -> None:
    """400 for a malformed assistant ``tool_calls`` list or a ``tool`` message without ``tool_call_id``."""
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue  # the tokenizer's message checks name this one
        role = message.get("role")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise InvalidRequestError(f"messages[{index}].tool_calls is only allowed on assistant messages")
            if not isinstance(calls, list):
                raise InvalidRequestError(f"messages[{index}].tool_calls must be a list")
            for call_index, call in enumerate(calls):
                where = f"messages[{index}].tool_calls[{call_index}]"
                function = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(function, Mapping) or not isinstance(call.get("id"), str):
                    raise InvalidRequestError(f"{where} must have an 'id' and a 'function' object")
                if not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str):
                    raise InvalidRequestError(f"{where}.function needs 'name' and 'arguments' (a JSON string)")
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str) or not message.get("tool_call_id"):
                raise InvalidRequestError(f"messages[{index}] (role 'tool') needs a 'tool_call_id' string")
            content = message.get("content")
            if content is None:
                raise InvalidRequestError(f"messages[{index}] (role 'tool') needs 'content'")
            if not isinstance(content, str) and not (
                    isinstance(content, list) and all(isinstance(part, Mapping) and part.get("type") == "text"
                                                      and isinstance(part.get("text"), str) for part in content)):
                raise InvalidRequestError(
                    f"messages[{index}].content (role 'tool') must be a string or a list of text parts")


def _arguments_object(arguments: str) -> Any:
    # Arguments arrive as JSON text; embed them as JSON (not a string of JSON) when they parse.
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    # A list of text parts (check_tool_messages made sure of it), joined as the tokenizer joins them.
    return "\n".join(part["text"] for part in content)


# ---------------------------------------------------------------------------------------------
# Parsing the output


def parse_tool_calls(text: str, request: ToolRequest) -> list[ToolCall] | None:
    """The tool calls ``text`` makes, or None when it is not a tool call (then it is content)."""
    if not request.active:
        return None
    if request.choice == "function":
        arguments = _load_json(text.strip())
        if not isinstance(arguments, dict):
            return None
        return [ToolCall(new_call_id(), request.function_name, _dump(arguments))]
    for candidate in _candidates(text.strip()):
        calls = _calls_of(candidate, request)
        if calls:
            return calls
    return None


def _candidates(text: str) -> list[str]:
    tagged = _TOOL_CALL_TAGS.findall(text)
    if tagged and text.startswith("<tool_call>"):
        # Several tagged calls: join them into one JSON list.
        return ["[" + ",".join(tagged) + "]"] if len(tagged) > 1 else tagged
    fenced = _FENCED.match(text)
    if fenced:
        return [fenced.group(1).strip()]
    return [text]


def _calls_of(candidate: str, request: ToolRequest) -> list[ToolCall] | None:
    value = _load_json(candidate)
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name = item.get("name")
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _load_json(arguments)
        if not isinstance(name, str) or request.tool(name) is None or not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(new_call_id(), name, _dump(arguments)))
    if len(calls) > 1 and not request.parallel:
        calls = calls[:1]  # parallel_tool_calls=false: one call per turn
    return calls


def _load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _dump(arguments: dict) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def could_be_tool_call(text: str) -> bool:
    """Whether ``text`` (the output so far) may still turn out to be a tool call in ``auto`` mode."""
    stripped = text.lstrip()
    if not stripped:
        return True
    if stripped[0] in "{[":
        return True
    return any(marker.startswith(stripped[:len(marker)]) for marker in ("<tool_call>", "```"))


class ToolCallStream:
    """Streaming: holds the text back while it may be a tool call, then yields content or call deltas.

    ``feed(text)`` returns the content to send now ("" while holding back); ``finish()`` returns the tool
    calls once the output ended (None if it was not a call: then ``finish_content`` is the held text).
    """

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self._held: list[str] = []
        # Constrained output is a call by construction: hold everything until the end.
        self._deciding = request.active

    def feed(self, text: str) -> str:
        if not self._deciding:
            return text
        self._held.append(text)
        held = "".join(self._held)
        if self.request.constrained or could_be_tool_call(held):
            return ""
        self._deciding = False
        self._held = []
        return held

    def finish(self) -> list[ToolCall] | None:
        """Tool calls of the whole held output, or None (then send ``finish_content()`` as content)."""
        if not self._deciding:
            return None
        return parse_tool_calls("".join(self._held), self.request)

    def finish_content(self) -> str:
        """The held text when ``finish()`` found no call."""
        held = "".join(self._held)
        self._held = []
        return held


# ---------------------------------------------------------------------------------------------
# Response shapes


def tool_calls_message(calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant ``message`` of a non-streamed answer that calls tools (finish_reason "tool_calls")."""
    return {"role": "assistant", "content": None, "tool_calls": [call.openai() for call in calls]}


def tool_call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Stream ``delta`` objects for ``calls`` in OpenAI's shape: per call, first index/id/type/name with
    empty arguments, then the arguments."""
    deltas = []
    for index, call in enumerate(calls):
        deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
    return deltas


TOOL_CALLS_FINISH_REASON = "tool_calls"
