"""Tool calls in the model family's own format, as llama.cpp's common/chat.cpp reads them: the
chat template renders the tools (`tools=` in its variables), the model writes its calls in the
family's syntax, and the text is parsed back into OpenAI's `tool_calls`.

Formats, chosen from the chat template's text:
- hermes (Qwen 2.5 / Qwen 3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call;
- llama3 (Llama 3.1+): a JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

When the client requires a call (`tool_choice` "required" or a named function) the output is
held to the format by a grammar (structured_output.py): the family's markers around JSON valid
against a call schema (the function's name as a constant, its parameters' schema for the
arguments).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

JsonSchema = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: JsonSchema

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request holds it: what chat templates expect in `tools`."""
        function = {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """One family's syntax: what comes before and after the calls' JSON, and its name key."""

    name: str
    prefix: str  # before the JSON of the calls
    suffix: str  # after it
    arguments_key: str  # "arguments" or "parameters"
    array: bool  # the calls as one JSON array (mistral) or one object per call

    def call_schema(self, tools: Sequence[Tool]) -> dict[str, Any]:
        """JSON that is one call of one of `tools` (an array of them in array formats)."""
        options = [{"type": "object", "properties": {"name": {"const": t.name}, self.arguments_key: t.parameters},
                    "required": ["name", self.arguments_key]} for t in tools]
        one = options[0] if len(options) == 1 else {"anyOf": options}
        return {"type": "array", "items": one, "minItems": 1} if self.array else one

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside the calls, or None when empty; the calls) of a model's answer; text
        that does not hold a well-formed call is all content."""
        calls: list[ToolCall] = []
        outside: list[str] = []
        rest = text
        while True:
            start = rest.find(self.prefix) if self.prefix else _first_json(rest)
            if start < 0 or (not self.prefix and rest[:start].replace("<|python_tag|>", "").strip()):
                outside.append(rest)  # no call, or (llama3) a call that does not open the answer
                break
            decoded = _decode_json(rest, start + len(self.prefix))
            if decoded is None:
                outside.append(rest)
                break
            value, end = decoded
            found = self._calls(value)
            if found is None:
                outside.append(rest)
                break
            calls.extend(found)
            outside.append(rest[:start].replace("<|python_tag|>", ""))
            end = _skip(rest, end, self.suffix)
            rest = rest[end:]
            if not self.prefix:
                rest = rest.lstrip().removeprefix(";")
        content = "".join(outside).strip()
        return (content or None), calls

    def _calls(self, value: Any) -> list[ToolCall] | None:
        items = value if self.array and isinstance(value, list) else [value]
        calls = []
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                return None
            arguments = item.get(self.arguments_key, item.get("arguments", {}))
            calls.append(ToolCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
        return calls


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", array=False)
LLAMA3 = ToolFormat("llama3", "", "", "parameters", array=False)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", array=True)


def detect_format(template: str) -> ToolFormat | None:
    """The tool-call format a chat template writes (None: the template knows no tools)."""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and "tools" in template):
        return LLAMA3
    return None


def _first_json(text: str) -> int:
    match = re.search(r"(<\|python_tag\|>)?\s*\{", text)
    return -1 if match is None else match.end() - 1


def _decode_json(text: str, at: int) -> tuple[Any, int] | None:
    at = len(text) - len(text[at:].lstrip())
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None


def _skip(text: str, at: int, suffix: str) -> int:
    """Past `suffix` at `at` (whitespace around it allowed), else `at`."""
    stripped = text[at:].lstrip()
    if suffix.strip() and stripped.startswith(suffix.strip()):
        return len(text) - len(stripped) + len(suffix.strip())
    return at
