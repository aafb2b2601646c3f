"""Prompts as token ids: plain text or chat messages through the model's template, with the BOS
and end-of-generation ids the manifest's tokenizer facts give. Shared by `ggufc run`, the Python
API and the server, so all feed a model the same ids for the same prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ggufc.messages import GgufcError


def tokenizer_from_session(session: Any) -> tuple[Any, dict[str, Any]]:
    """The artifact's tokenizer and its manifest facts (BOS/EOS, template, ...)."""
    from .tokenizer import Tokenizer

    info = dict(session.manifest.get("tokenizer") or {})
    path = session.tokenizer_path
    if path is None:
        raise GgufcError("this model has no text tokenizer (its GGUF vocabulary has no text form)")
    info["tokenizer_json"] = path.read_text(encoding="utf-8")
    return Tokenizer.from_dict(info), info


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
    from .chat import ChatTemplateError, render_chat  # jinja2: loaded by the commands that render a chat

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


def prompt_ids(tokenizer: Any, info: dict[str, Any], prompt: str | list[dict[str, str]], *,
               chat: bool) -> list[int]:
    """Token ids of the prompt (special tokens parsed), through the chat template when asked (a
    list of messages is a conversation)."""
    text = chat_prompt(tokenizer, info, prompt) if chat else str(prompt)
    return encode_prompt(tokenizer, info, text, templated=chat)


def chat_prompt(tokenizer: Any, info: dict[str, Any], prompt: str | list[dict[str, str]]) -> str:
    if not info.get("chat_template"):
        raise GgufcError("--chat: this model has no chat template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return render_messages(tokenizer, info, messages)


def check_fits(n_tokens: int, n_ctx: int, what: str, hint: str) -> None:
    if n_tokens > n_ctx:
        raise GgufcError(f"{what} has {n_tokens} tokens, longer than the context ({n_ctx} tokens); {hint}")
