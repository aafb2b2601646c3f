"""Chat templates: transformers-compatible features and hostile templates.

SmolLM2's own template (read from its GGUF) is rendered and tokenized against llama.cpp's golden
prompts in test_tokenizer.py, which loads that file anyway.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from ggufc.runtime.chat import ChatTemplateError, render_chat

USER = [{"role": "user", "content": "What is 2+2?"}]


def _render(template: str, **kwargs: Any) -> str:
    return render_chat(template, USER, bos_token="<s>", eos_token="</s>", **kwargs)


# --- what transformers' environment offers ---------------------------------------------------


def test_bos_eos_and_extra_variables() -> None:
    template = (
        "{{ bos_token }}{% for t in tools %}[{{ t.name }}]{% endfor %}"
        "{{ messages[0].content }}{{ eos_token }}"
    )
    assert _render(template, tools=[{"name": "calc"}]) == "<s>[calc]What is 2+2?</s>"


def test_trim_and_lstrip_blocks() -> None:
    template = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n"
        "    {% endif %}\n{% endfor %}"
    )
    assert _render(template) == "What is 2+2?\n"


def test_loopcontrols_namespace_and_generation_block() -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}{% generation %}|gen{% endgeneration %}"
    )
    assert _render(template) == "3|gen"


def test_tojson_keeps_unicode_and_options() -> None:
    assert _render("{{ {'b': 'é', 'a': 1} | tojson(sort_keys=True) }}") == '{"a": 1, "b": "é"}'
    assert _render("{{ [1] | tojson(indent=2) }}") == "[\n  1\n]"


def test_strftime_now() -> None:
    assert len(_render("{{ strftime_now('%Y-%m-%d') }}")) == 10


def test_raise_exception_is_reported() -> None:
    with pytest.raises(ChatTemplateError, match="raised: Only user and assistant roles"):
        _render("{{ raise_exception('Only user and assistant roles are supported!') }}")


def test_syntax_error_is_one_line() -> None:
    with pytest.raises(ChatTemplateError, match=r"syntax error \(line 2\)") as info:
        _render("ok\n{% for %}")
    assert "\n" not in str(info.value)


# --- hostile templates -----------------------------------------------------------------------

INTERNALS = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ (messages|first).items.__self__.__class__ }}",
    "{% set x = namespace.__init__ %}{{ x }}",
]


@pytest.mark.parametrize("template", INTERNALS)
def test_python_internals_are_refused(template: str) -> None:
    with pytest.raises(ChatTemplateError, match="unsafe") as info:
        _render(template)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "exceeded 0.3 s"),
        (
            "{% set xs = range(99999)|list %}{% for a in xs %}{% for b in xs %}{% endfor %}{% endfor %}",
            "exceeded 0.3 s",
        ),
        ("{% for i in range(20000) %}{{ 'x' * 100 }}{% endfor %}", "output exceeds"),
        ("{{ 'x' * 10**9 }}", "limit"),
        ("{{ 7 ** 999999 }}", "bits"),
        ("{{ 'x'|center(10**9) }}", "limit"),
        ("{{ 'x'.ljust(10**9) }}", "limit"),
        ("{{ '%0999999999d' % 1 }}", "format width"),
        ("{{ '{:>999999999}'.format(1) }}", "format width"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "limit",
        ),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion"),
        ("{{ ('a\n' * 1000) | indent(100000) }}", "indented text"),
        ("{{ range(100000) | join('x' * 100) }}", "joined text"),
        ("{{ ('x' * 100).join(range(20000) | map('string') | list) }}", "joined text"),
        ("{{ [1] | tojson(indent=1000) }}", "tojson indent"),
        ("{{ messages.append(1) }}", "unsafe"),
        ("{{ lipsum(10**9) }}", "undefined"),
    ],
)
def test_runaway_templates_fail_fast(template: str, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=match) as info:
        # a short budget where the budget is the point; elsewhere the other limits must act first
        _render(template, timeout_s=0.3 if "exceeded" in match else 5.0)
    assert time.monotonic() - start < 2.0
    assert "\n" not in str(info.value)


def test_output_bound_is_configurable() -> None:
    assert _render("{{ 'x' * 100 }}", max_chars=100) == "x" * 100
    with pytest.raises(ChatTemplateError, match="exceeds 99 characters"):
        _render("{{ 'x' * 100 }}", max_chars=99)


def test_trace_hook_is_restored() -> None:
    before = sys.gettrace()
    _render("{% for i in range(3) %}{{ i }}{% endfor %}")
    with pytest.raises(ChatTemplateError):
        _render(
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", timeout_s=0.05
        )
    assert sys.gettrace() is before
