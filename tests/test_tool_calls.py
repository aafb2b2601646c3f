"""Tool calls parsed back from each family's format (as llama.cpp's common/chat.cpp reads them),
and the format a chat template writes."""

from __future__ import annotations

import json

from ggufc.runtime.tool_calls import HERMES, LLAMA3, MISTRAL, Tool, detect_format


def _calls(parsed: tuple[str | None, list]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed[1]]


def test_hermes_blocks_and_the_text_around_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    parsed = HERMES.parse(text)
    assert parsed[0] == "Let me check."
    assert _calls(parsed) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_llama3_json_at_the_start_with_or_without_the_python_tag() -> None:
    assert _calls(LLAMA3.parse('{"name": "f", "parameters": {"x": 1}}')) == [("f", {"x": 1})]
    parsed = LLAMA3.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    assert parsed[0] is None and _calls(parsed) == [("f", {"x": 1}), ("g", {})]
    assert LLAMA3.parse('The JSON is {"name": "f", "parameters": {}}')[1] == []  # not at the start: content


def test_mistral_array_after_its_marker() -> None:
    parsed = MISTRAL.parse('[TOOL_CALLS][{"name": "a", "arguments": {"q": "x"}}, {"name": "b", "arguments": {}}]')
    assert parsed[0] is None and _calls(parsed) == [("a", {"q": "x"}), ("b", {})]


def test_malformed_calls_are_content() -> None:
    assert HERMES.parse('<tool_call>\n{"name": broken') == ('<tool_call>\n{"name": broken', [])
    assert HERMES.parse("just text") == ("just text", [])
    assert MISTRAL.parse('[TOOL_CALLS]["not a call"]')[1] == []


def test_call_schemas_name_the_tools() -> None:
    tools = [Tool("a", "", {"type": "object"}), Tool("b", "", {"type": "object", "properties": {"x": {}}})]
    schema = HERMES.call_schema(tools)
    assert [o["properties"]["name"] for o in schema["anyOf"]] == [{"const": "a"}, {"const": "b"}]
    assert LLAMA3.call_schema(tools[:1])["required"] == ["name", "parameters"]
    assert MISTRAL.call_schema(tools[:1])["type"] == "array"


def test_formats_from_templates() -> None:
    assert detect_format("...<tool_call>...") is HERMES
    assert detect_format("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert detect_format("<|start_header_id|>ipython{% if tools %}") is LLAMA3
    assert detect_format("<|im_start|>{{ message.content }}") is None
