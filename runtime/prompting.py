"""Prompts as token ids: plain text or chat messages through the model's template, with the BOS
and end-of-generation ids the manifest's tokenizer facts give. Shared by `ggufc run` and the
server, so both feed a model the same ids for the same prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .chat import ChatTemplateError, render_chat


def special_text(tokenizer: Any, info: Mapping[str, Any], which: str) -> str:
    """The text of the BOS/EOS token, for chat templates ('' when the model has none)."""
    if info.get(f"{which}_token"):
        return str(info[f"{which}_token"])
    token_id = info.get(f"{which}_id")
    return str(tokenizer.token_text(int(token_id))) if token_id is not None else ""


def stop_ids(info: Mapping[str, Any]) -> set[int]:
    """The ids that end a generation: end-of-turn tokens and EOS."""
    ids = {int(t) for t in info.get("eot_ids") or []}
    if info.get("eos_id") is not None:
        ids.add(int(info["eos_id"]))
    return ids


def render_messages(tokenizer: Any, info: Mapping[str, Any], messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """`messages` through the model's chat template, ending with the assistant's turn opened
    (`tools`: OpenAI's tool definitions, for templates that render them)."""
    template = info.get("chat_template")
    if not template:
        raise ChatTemplateError("this model has no chat template")
    return render_chat(
        str(template),
        messages,
        add_generation_prompt=True,
        bos_token=special_text(tokenizer, info, "bos"),
        eos_token=special_text(tokenizer, info, "eos"),
        tools=list(tools) if tools else None,
    )


def encode_prompt(tokenizer: Any, info: Mapping[str, Any], text: str, *, templated: bool) -> list[int]:
    """Token ids of `text` (special tokens parsed), BOS added as the model wants it; a `templated`
    text that already starts with the BOS text (written by the chat template) gets no second one."""
    bos = special_text(tokenizer, info, "bos")
    add_bos = bool(info.get("add_bos")) and not (templated and bos and text.startswith(bos))
    return [int(t) for t in tokenizer.encode(text, add_bos=add_bos, parse_special=True)]
