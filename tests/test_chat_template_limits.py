"""A chat template is a checkpoint's code: one that builds huge strings or never stops
looping is refused with ChatTemplateError (INVALID_ARGUMENT at the doors), in bounded
memory and time, while a real template renders as before. Plain code, no server.
"""

from __future__ import annotations

import pytest

from model_service.text.chat_template import ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "hi"}]
BUDGET = 100_000


@pytest.mark.parametrize("source", [
    '{{ ("x" * 200000000)|length }}',
    '{{ "x"|center(200000000) }}',
    '{{ "x"|indent(200000000, true) }}',
    '{{ 10 ** 100000000 }}',
    '{% set ns = namespace(s="x") %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}',
    '{% set ns = namespace(s="x") %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}',
    '{% macro grow(s, n) %}{{ grow(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ grow("x", 60) }}',
    '{% for i in range(100000) %}{{ "y" * 50 }}{% endfor %}',
], ids=["repeat", "center", "indent", "power", "concat-doubling", "plus-doubling", "macro-doubling", "output"])
def test_a_template_building_past_its_budget_is_refused(source):
    with pytest.raises(ChatTemplateError, match="went over its limits"):
        ChatTemplate(source).render(MESSAGES, max_chars=BUDGET)


def test_a_template_that_loops_for_ever_is_ended_at_its_deadline():
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="ran longer than 0.2 s"):
        ChatTemplate(source).render(MESSAGES, seconds=0.2)


def test_a_real_template_renders_within_its_limits():
    source = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
              "{{ message['content'] | trim }}{{ eos_token }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    messages = [{"role": "system", "content": "s" * 40_000}, {"role": "user", "content": " hi "}]
    text = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages, max_chars=BUDGET)
    assert text == f"<s><|system|>\n{'s' * 40_000}</s>\n<|user|>\nhi</s>\n<|assistant|>\n"
