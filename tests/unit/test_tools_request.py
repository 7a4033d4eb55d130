"""frontend/request/tools.py and frontend/output/tool_calls.py: every tool_choice becomes its plan (the
grammar of ``required`` and of a named function accepts exactly the calls it should), shape problems are
400s naming their path, and the chunks and messages carry OpenAI's tool-call shapes."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import msgspec
import pytest

from trioserve.config import RequestConfig
from trioserve.frontend.output.tool_calls import ToolChunkEncoder, tool_message
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import ChatCompletionRequest
from trioserve.frontend.request.structured import GrammarCache, checked_grammar
from trioserve.frontend.request.tools import ToolsPlan, tools_plan

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "now", "description": "the time"}},
]
AUTO = RequestConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def plan(limits: RequestConfig = AUTO, **fields: Any) -> ToolsPlan | None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return tools_plan(msgspec.convert(body, ChatCompletionRequest), limits)


def refused(limits: RequestConfig = AUTO, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        plan(limits, **fields)
    assert info.value.status == 400
    return info.value


def accepts(grammar: str, text: str) -> bool:
    """Whether ``text`` is a complete match of ``grammar`` (llguidance's own check, byte by byte)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.ByteFallback()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(tok.to_str(), n_vocab=257, eos_token=256), grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def test_the_modes() -> None:
    assert plan() is None and plan(tool_choice="none") is None
    auto = plan(tools=TOOLS)
    assert auto is not None and auto.mode == "auto" and auto.parser == "hermes" and auto.grammar is None
    none = plan(tools=TOOLS, tool_choice="none")
    assert none is not None and none.mode == "none" and none.output_format() is None and none.tools == TOOLS
    named = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert named is not None and named.mode == "named" and named.grammar is not None
    assert json.loads(named.grammar.text) == PARAMS


@pytest.mark.parametrize("parallel", [None, False])
def test_required_accepts_exactly_calls_of_the_tools(parallel: bool | None) -> None:
    p = plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    assert p is not None and p.grammar is not None
    grammar = checked_grammar(GrammarCache(), p.grammar)
    one = '[{"name": "weather", "parameters": {"city": "Paris"}}]'
    two = '[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    assert accepts(grammar, one)
    assert accepts(grammar, two) is (parallel is None)
    for bad in (
        "[]",
        '[{"name": "rain", "parameters": {}}]',
        '[{"name": "weather", "parameters": {}}]',
        "hello",
    ):
        assert not accepts(grammar, bad), bad


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rain"}}},
            "tool_choice",
            "not in tools",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
            "tools[0].function.name",
            "1-64",
        ),
        ({"tools": [{"type": "code"}], "tool_choice": "none"}, "tools[0]", "function"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "none"}, "tools", "distinct"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
                "tool_choice": "none",
            },
            "tools[0].function.parameters",
            "schema",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}], "tool_choice": "none"},
            "tools[0].function",
            "unknown",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
                "tool_choice": "auto",
            },
            "tools",
            "strict",
        ),
    ],
)
def test_refusals(fields: dict[str, Any], param: str, words: str) -> None:
    limits = RequestConfig() if fields.get("tool_choice") is None or fields.get("tools") == TOOLS else AUTO
    error = refused(limits, **fields)
    assert error.param == param and words in error.message


def test_chunks_carry_openai_tool_call_deltas() -> None:
    p = plan(tools=TOOLS, tool_choice="required")
    assert p is not None
    fmt = p.output_format()
    assert fmt is not None
    encoder = ToolChunkEncoder("chat", "chatcmpl-x", 1, "m", False, None, fmt, 1)
    text = '[{"name": "weather", "parameters": {"city": "Paris"}}]'
    cut = text.index('{"city') + 1
    chunks = [
        json.loads(encoder.delta(0, text[:cut], [1])),
        json.loads(encoder.delta(0, text[cut:], [2], "stop", 2)),
    ]
    first = chunks[0]["choices"][0]
    assert first["delta"]["tool_calls"][0]["function"] == {"name": "weather", "arguments": "{"}
    assert (
        first["delta"]["tool_calls"][0]["id"].startswith("chatcmpl-tool-") and "content" not in first["delta"]
    )
    last = chunks[1]["choices"][0]
    assert last["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": '"city": "Paris"}'}}]
    assert last["finish_reason"] == "tool_calls" and last["stop_reason"] == 2
    message, made = tool_message(text, fmt)
    assert made and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}


def test_single_keeps_the_first_call_and_named_finishes_with_stop() -> None:
    auto = plan(tools=TOOLS, parallel_tool_calls=False)
    assert auto is not None
    fmt = auto.output_format()
    assert fmt is not None
    call = '<tool_call>{"name": "%s", "arguments": {}}</tool_call>'
    text = call % "now" + call % "weather"
    message, _ = tool_message(text, fmt)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["now"]
    named = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert named is not None
    nfmt = named.output_format()
    assert nfmt is not None
    assert nfmt.finish_reason("stop", True) == "stop" and fmt.finish_reason("stop", True) == "tool_calls"
    assert fmt.finish_reason("length", True) == "length" and fmt.finish_reason("stop", False) == "stop"


def test_auto_streams_the_same_calls_and_content_as_the_full_message() -> None:
    auto = plan(tools=TOOLS)
    assert auto is not None
    fmt = auto.output_format()
    assert fmt is not None
    text = 'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    for size in (1, 3, 8, len(text)):
        encoder = ToolChunkEncoder("chat", "chatcmpl-x", 1, "m", False, None, fmt, 1)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        chunks = [
            json.loads(encoder.delta(0, p, [0], "stop" if i == len(pieces) - 1 else None))["choices"][0]
            for i, p in enumerate(pieces)
        ]
        content = "".join(c["delta"].get("content", "") for c in chunks)
        calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
        assert content == "Checking." and chunks[-1]["finish_reason"] == "tool_calls"
        assert calls[0]["function"]["name"] == "weather" and len({t["index"] for t in calls}) == 1
        assert "".join(t["function"]["arguments"] for t in calls) == '{"city": "Paris"}'
    message, made = tool_message(text, fmt)
    assert made and message["content"] == "Checking."
