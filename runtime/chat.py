"""Render a model's chat template (jinja2) safely, as Hugging Face transformers does.

The environment matches transformers' `apply_chat_template`: an `ImmutableSandboxedEnvironment`
with trim_blocks/lstrip_blocks, the loopcontrols extension, a `{% generation %}` block, the
`raise_exception` and `strftime_now` globals and transformers' `tojson` filter. A template comes
from a model file, so it is treated as untrusted code:

- Python internals (`__class__`, `__globals__`, ...) raise instead of rendering as empty.
- Rendering has a wall-clock budget: a trace hook on the template's own code checks the
  deadline on every line, which stops runaway loops and recursion.
- Every value built along the way, and the output, is bounded (1 MiB by default): the growing
  operators (`*`, `**`, `+`, `%`), method calls, filters and namespace assignments are checked.

Every failure is a `ChatTemplateError` with a one-line message.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from contextlib import contextmanager
from datetime import datetime
from types import FrameType
from typing import Any, TypeGuard

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import Context, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from ggufc.messages import GgufcError

MAX_OUTPUT_CHARS = 1 << 20  # also the bound on any string or list built while rendering
DEFAULT_TIMEOUT_S = 2.0
_MAX_INT_BITS = 4096  # numbers beyond this are no chat template's business
_TEMPLATE_FILENAME = "<template>"  # jinja2's code filename for templates made from strings


class ChatTemplateError(GgufcError, ValueError):
    """A chat template that cannot be rendered safely (one-line message)."""


class _Raised(jinja2.TemplateError):
    """`raise_exception(...)` called by the template itself."""


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_chars: int = MAX_OUTPUT_CHARS,
    **context: Any,
) -> str:
    """Render `template` for `messages` (extra variables, e.g. `tools=`, go in `context`)."""
    variables = {
        "messages": [dict(m) for m in messages],
        "bos_token": bos_token,
        "eos_token": eos_token,
        "add_generation_prompt": add_generation_prompt,
        **context,
    }
    try:
        compiled = _compile(template)
        return _render(compiled, variables, _Deadline(timeout_s), max_chars)
    except ChatTemplateError:
        raise
    except Exception as exc:  # any other failure of untrusted template code
        raise ChatTemplateError(_describe(exc)) from None


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _ENV.from_string(template)


def _render(compiled: jinja2.Template, variables: dict[str, Any], deadline: _Deadline, max_chars: int) -> str:
    chunks: list[str] = []
    size = 0
    with _watchdog(deadline):
        for chunk in compiled.generate(variables):
            size += len(chunk)
            if size > max_chars:
                raise ChatTemplateError(f"chat template output exceeds {max_chars} characters")
            chunks.append(chunk)
    return "".join(chunks)


def _describe(exc: BaseException) -> str:
    """One line naming what went wrong inside the template."""
    message = _one_line(exc)
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"chat template syntax error (line {exc.lineno}): {message}"
    if isinstance(exc, SecurityError):
        return f"chat template is unsafe: {message}"
    if isinstance(exc, _Raised):
        return f"chat template raised: {message}"
    if isinstance(exc, RecursionError):
        return "chat template recursion is too deep"
    if isinstance(exc, MemoryError):
        return "chat template ran out of memory"
    if isinstance(exc, jinja2.TemplateError):
        return f"chat template error: {message}"
    return f"chat template failed: {type(exc).__name__}: {message}"


def _one_line(exc: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(exc)).strip()
    return text[:300] or type(exc).__name__


# --- time budget ---------------------------------------------------------------------------


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.end:
            raise ChatTemplateError(f"chat template render exceeded {self.seconds:g} s (runaway loop?)")


@contextmanager
def _watchdog(deadline: _Deadline) -> Iterator[None]:
    """Check the deadline on every line of template code (and only there, to stay cheap)."""

    def on_line(frame: FrameType, event: str, arg: Any) -> Any:
        deadline.check()
        return on_line

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != _TEMPLATE_FILENAME:
            return None
        deadline.check()
        return on_line

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


# --- size guards -----------------------------------------------------------------------------


_SIZED_TYPES = (str, bytes, list, tuple, dict)  # a tuple: isinstance on `A | B` is 10x slower


def _check_size(value: Any) -> None:
    if isinstance(value, _SIZED_TYPES) and len(value) > MAX_OUTPUT_CHARS:
        raise ChatTemplateError(
            f"chat template built a value of {len(value)} items (limit {MAX_OUTPUT_CHARS})"
        )
    if isinstance(value, int):
        _check_bits(value.bit_length())


def _check_width(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OUTPUT_CHARS:
        raise ChatTemplateError(f"chat template asked for {what} {value} (limit {MAX_OUTPUT_CHARS})")


def _check_format_string(fmt: Any) -> None:
    """Refuse printf/format widths that would build huge strings ('%0999999999d', '{:>1e9}')."""
    if isinstance(fmt, str):
        for digits in re.findall(r"\d{7,}", fmt):
            _check_width(int(digits), "a format width of")


def _is_sized(value: Any) -> TypeGuard[Sized]:
    return isinstance(value, Sized)


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            if _is_sized(seq) and isinstance(count, int):
                _check_width(len(seq) * count, "a repeated value of length")
        if isinstance(left, int) and isinstance(right, int):
            _check_bits(left.bit_length() + right.bit_length())
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        if abs(left) > 1:
            _check_bits(left.bit_length() * right)
    elif operator == "+" and _is_sized(left) and _is_sized(right):
        _check_width(len(left) + len(right), "a concatenation of length")
    elif operator == "%" and isinstance(left, str):
        _check_format_string(left)
        if "*" in left:  # '%*d': the width comes from the arguments
            for value in right if isinstance(right, tuple) else (right,):
                _check_width(value, "a format width of")


def _check_bits(bits: int) -> None:
    if bits > _MAX_INT_BITS:
        raise ChatTemplateError(f"chat template built a number over {_MAX_INT_BITS} bits")


_PADDING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})


def _check_call(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse method calls that build huge strings from small inputs."""
    method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in _PADDING_METHODS:
        for value in (*args, *kwargs.values()):
            _check_width(value, f"{name}() of")
    elif name in ("format", "format_map"):
        _check_format_string(owner)
        if re.search(r"\{[^{}]*:[^{}]*\{", owner):  # '{:{}}': the width comes from the arguments
            for value in (*args, *kwargs.values()):
                _check_width(value, "a format width of")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        _check_width(len(owner) + count * len(args[1]), "a replace() result of length")
    elif name == "join" and args and _is_sized(args[0]):
        _check_width(len(owner) * len(args[0]), "a joined text of length")


# --- filters: each check sees the filter's arguments by name, before the filter runs --------


def _limit_indent(a: dict[str, Any]) -> None:
    width = a.get("width")
    per_line = len(width) if isinstance(width, str) else width
    if isinstance(per_line, int):
        _check_width((str(a.get("s", "")).count("\n") + 1) * per_line, "an indented text of length")


def _limit_wordwrap(a: dict[str, Any]) -> None:
    width, wrap = a.get("width"), a.get("wrapstring")
    if isinstance(width, int) and isinstance(wrap, str):
        _check_width((len(str(a.get("s", ""))) // max(width, 1) + 1) * len(wrap), "a wrapped text of length")


def _limit_replace(a: dict[str, Any]) -> None:
    text, old, new = a.get("s"), a.get("old"), a.get("new")
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        count = text.count(old) if old else len(text) + 1
        _check_width(len(text) + count * len(new), "a replace result of length")


def _limit_join(a: dict[str, Any]) -> None:
    value, sep = a.get("value"), a.get("d")
    if _is_sized(value) and isinstance(sep, str):
        _check_width(len(sep) * len(value), "a joined text of length")


def _limit_tojson(a: dict[str, Any]) -> None:
    indent = a.get("indent")
    size = len(indent) if isinstance(indent, str) else indent
    if isinstance(size, int) and size > _MAX_JSON_INDENT:
        raise ChatTemplateError(f"chat template asked for tojson indent {size} (limit {_MAX_JSON_INDENT})")


_MAX_JSON_INDENT = 64  # every nested line repeats it
_FILTER_LIMITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "center": lambda a: _check_width(a.get("width"), "center width"),
    "batch": lambda a: _check_width(a.get("linecount"), "batch size"),
    "slice": lambda a: _check_width(a.get("slices"), "slice count"),
    "format": lambda a: _check_format_string(a.get("value")),
    "indent": _limit_indent,
    "wordwrap": _limit_wordwrap,
    "replace": _limit_replace,
    "join": _limit_join,
    "tojson": _limit_tojson,
}


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a filter: refuse arguments that would build a huge value, bound the result."""
    limit = _FILTER_LIMITS.get(name)
    signature = inspect.signature(func) if limit else None

    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment markers
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if limit is not None and signature is not None:
            bound = signature.bind(*args, **kwargs)  # a bad call raises TypeError, as the filter would
            bound.apply_defaults()
            limit(bound.arguments)
        result = func(*args, **kwargs)
        _check_size(result)
        return result

    return guarded


class _BoundedNamespace(Namespace):
    """`namespace()` whose attributes cannot hold huge values (set in loops, they accumulate)."""

    def __setitem__(self, name: str, value: Any) -> None:
        _check_size(value)
        super().__setitem__(name, value)


# --- environment ---------------------------------------------------------------------------


class _GenerationBlock(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})  # the operators that can grow values

    def unsafe_undefined(self, obj: Any, attribute: str) -> Undefined:
        # the stock sandbox renders these as empty; a template that tries is refused instead
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        _check_size(result)
        return result

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(result)
        return result


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping, unicode kept
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _make_env() -> _Sandbox:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _BoundedNamespace
    env.globals.pop("lipsum", None)  # lipsum(n) loops n times outside the watched template code
    return env


_ENV = _make_env()
