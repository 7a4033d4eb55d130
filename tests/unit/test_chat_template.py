"""Chat templates (``frontend/text/chat_template.py``): rendering agrees with transformers'
``apply_chat_template``, ``continue_final_message`` leaves the final message open, failures are one-line
``ValueError``s, the request-template cache is a bounded LRU; ``--chat-template`` reads a file or takes
the string, and one that does not compile is exit code 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trioserve.cli import build_parser, main, serve_config
from trioserve.frontend.text.chat_template import (
    MAX_CACHED_CHARS,
    ChatTemplateCache,
    TemplateRenderError,
    compile_chat_template,
    read_chat_template,
)
from trioserve.frontend.text.tokenizer import Tokenizer

USER = {"role": "user", "content": "Capital of France?"}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [USER],
    [{"role": "system", "content": "Be terse."}, USER, {"role": "assistant", "content": "Paris."}, USER],
    [{"role": "user", "content": "hi", "name": "ann"}],
]
# A template that reads what transformers hands every template: special tokens, kwargs, tools.
PROBE = (
    "{{ eos_token }}|{{ tools is none }}|{{ documents is none }}|{{ flavour | default('plain') }}|"
    "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}={{ m.content }};"
    "{% endfor %}{% if add_generation_prompt %}GO{% endif %}"
)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("source", ["model", "probe"])
def test_rendering_agrees_with_transformers(
    qwen3_tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool, source: str
) -> None:
    hf = qwen3_tokenizer.hf_tokenizer
    template = None if source == "model" else compile_chat_template(PROBE)
    kwargs: dict[str, Any] = {"flavour": "spicy"}
    ours = qwen3_tokenizer.render_chat_template(messages, add_generation_prompt, kwargs, template=template)
    theirs = hf.apply_chat_template(
        messages,
        chat_template=None if template is None else PROBE,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **kwargs,
    )
    assert ours == theirs


@pytest.mark.parametrize("final", ["The answer is", "Paris, ", "  indented\n"])
def test_continue_final_message_agrees_with_transformers(qwen3_tokenizer: Tokenizer, final: str) -> None:
    messages = [USER, {"role": "assistant", "content": final}]
    ours = qwen3_tokenizer.render_chat_template(messages, False, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\n" + final)  # open: no <|im_end|> after the text
    theirs = qwen3_tokenizer.hf_tokenizer.apply_chat_template(
        messages, continue_final_message=True, tokenize=False
    )
    # transformers drops trailing whitespace the template would not have kept; ChatML keeps it all.
    assert ours == theirs or ours.rstrip() == theirs


def test_continue_final_message_needs_the_text_rendered_as_written(qwen3_tokenizer: Tokenizer) -> None:
    drops = compile_chat_template("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    with pytest.raises(TemplateRenderError, match="cannot be continued"):
        qwen3_tokenizer.render_chat_template([USER], False, template=drops, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot both be true"):
        qwen3_tokenizer.render_chat_template([USER], True, continue_final_message=True)


@pytest.mark.parametrize("name", ["chat_template", "messages", "continue_final_message", "tokenize"])
def test_kwargs_cannot_set_what_the_request_sets(qwen3_tokenizer: Tokenizer, name: str) -> None:
    # chat_template among them: no way around --trust-request-chat-template through the kwargs.
    with pytest.raises(ValueError, match=f"may not set {name}"):
        qwen3_tokenizer.render_chat_template([USER], chat_template_kwargs={name: "x"})


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("{% for m in messages %}", "does not compile: line 1"),
        ("line one\n{{ 1 + }}", "does not compile: line 2"),
        ("{% if %}" * 3000, "does not compile"),
    ],
)
def test_a_template_that_does_not_compile_is_one_line(source: str, words: str) -> None:
    with pytest.raises(ValueError, match=words) as info:
        compile_chat_template(source)
    assert "\n" not in str(info.value)


def test_render_failures_are_one_line_and_the_requests() -> None:
    template = compile_chat_template("{{ raise_exception('no\\nsystem prompt') }}")
    with pytest.raises(TemplateRenderError, match="TemplateError: no system prompt") as info:
        template.render([USER], add_generation_prompt=True)
    assert "\n" not in str(info.value)


def test_the_cache_compiles_each_text_once_and_keeps_the_most_recent() -> None:
    cache = ChatTemplateCache(size=2)
    a, b, c = "A{{ messages | length }}", "B", "C"
    first = cache.get(a)
    assert cache.get(a) is first and cache.compiles == 1
    cache.get(b)
    cache.get(a)  # a is now the most recent
    cache.get(c)  # evicts b
    assert len(cache) == 2 and cache.compiles == 3
    assert cache.get(a) is first and cache.compiles == 3
    cache.get(b)
    assert cache.compiles == 4
    big = "x" * (MAX_CACHED_CHARS + 1)  # compiled, used, never kept
    cache.get(big)
    cache.get(big)
    assert cache.compiles == 6 and len(cache) == 2
    with pytest.raises(ValueError, match="does not compile"):
        cache.get("{{")


def test_the_tokenizer_recompiles_its_template_when_it_changes(qwen3_tokenizer: Tokenizer) -> None:
    hf = qwen3_tokenizer.hf_tokenizer
    saved = hf.chat_template
    try:
        hf.chat_template = "ONE"
        assert qwen3_tokenizer.render_chat_template([USER]) == "ONE"
        hf.chat_template = "TWO"
        assert qwen3_tokenizer.render_chat_template([USER]) == "TWO"
    finally:
        hf.chat_template = saved


# ---- --chat-template -----------------------------------------------------------------------------------


def test_read_chat_template_takes_a_file_or_the_string(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("FROM FILE {{ messages[0].content }}", encoding="utf-8")
    assert read_chat_template(str(path)) == "FROM FILE {{ messages[0].content }}"
    assert read_chat_template("{{ messages }}") == "{{ messages }}"
    long = "{{ messages }}" + "x" * 10_000  # too long for a file name: still a template
    assert read_chat_template(long) == long
    (tmp_path / "bad.jinja").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"bad\.jinja"):
        read_chat_template(str(tmp_path / "bad.jinja"))


def test_the_flag_puts_the_templates_text_in_the_tree(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("T{{ messages[0].content }}", encoding="utf-8")
    parser = build_parser()
    config = serve_config(parser.parse_args(["serve", "--chat-template", str(path)]))
    assert config.frontend.request.chat_template == "T{{ messages[0].content }}"
    inline = serve_config(parser.parse_args(["serve", "--chat-template", "I{{ 1 }}"]))
    assert inline.frontend.request.chat_template == "I{{ 1 }}"
    assert serve_config(parser.parse_args(["serve"])).frontend.request.chat_template is None
    trusted = serve_config(parser.parse_args(["serve", "--trust-request-chat-template"]))
    assert trusted.frontend.request.trust_request_chat_template


@pytest.mark.parametrize("template", ["{% for m in messages %}", "file"])
def test_a_chat_template_that_does_not_compile_exits_2_with_one_line(
    template: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if template == "file":
        path = tmp_path / "broken.jinja"
        path.write_text("{{ messages\n", encoding="utf-8")
        template = str(path)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--chat-template", template])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --chat-template: the chat template does not compile" in err


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be terse."},
    USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "21"},
    {"role": "tool", "tool_call_id": "c2", "content": "19"},
]


@pytest.mark.parametrize("source", ["model", "probe"])
def test_tools_and_tool_turns_agree_with_transformers(qwen3_tokenizer: Tokenizer, source: str) -> None:
    """The request's tools reach the template as ``tools``, as transformers passes them."""
    template = None if source == "model" else compile_chat_template(PROBE)
    ours = qwen3_tokenizer.render_chat_template(TOOL_CONVERSATION, True, template=template, tools=[TOOL])
    theirs = qwen3_tokenizer.hf_tokenizer.apply_chat_template(
        TOOL_CONVERSATION,
        tools=[TOOL],
        chat_template=None if template is None else PROBE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert ours == theirs


def test_the_qwen3_template_renders_tools_in_qwen3s_format(qwen3_tokenizer: Tokenizer) -> None:
    text = qwen3_tokenizer.render_chat_template(TOOL_CONVERSATION, True, tools=[TOOL])
    assert text.startswith("<|im_start|>system\nBe terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in text
    assert (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\n19\n</tool_response><|im_end|>\n"
    ) in text
    assert text.count("Be terse.") == 1 and text.endswith("<|im_start|>assistant\n")
    plain = qwen3_tokenizer.render_chat_template([USER], True)
    assert "# Tools" not in plain  # no tools: the template as it was
