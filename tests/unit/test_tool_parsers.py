"""frontend/output/tool_parsers.py: known texts give the known calls, and any chunking of a text gives
what the whole text gives (the parsers' stated rule), for generated conversations too."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.frontend.output.tool_parsers import (
    ForcedParser,
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    ToolOutput,
    ToolParser,
)

Calls = list[tuple[str, str]]


def merged(outputs: list[ToolOutput]) -> tuple[str, Calls, int]:
    content = "".join(o.content for o in outputs)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for o in outputs:
        for d in o.calls:
            if d.name is not None:
                assert d.index not in names, "a call's name comes once"
                names[d.index] = d.name
            assert d.index in names, "a call's first delta has its name"
            args[d.index] = args.get(d.index, "") + d.arguments
    assert sorted(names) == list(range(len(names))), "calls are numbered 0, 1, ..."
    return content, [(names[i], args[i]) for i in sorted(names)], sum(o.errors for o in outputs)


def run(make: Callable[[], ToolParser], pieces: list[str]) -> tuple[str, Calls, int]:
    parser = make()
    return merged([*(parser.feed(p) for p in pieces), parser.finish()])


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


WEATHER = '{"city": "Paris", "note": "a } and a \\" inside", "days": [1, {"x": "]"}]}'
CASES: list[tuple[Callable[[], ToolParser], str, str, Calls]] = [
    (
        HermesParser,
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n',
        "Let me check.",
        [("get_weather", WEATHER), ("now", "{}")],
    ),
    (HermesParser, "No tools needed.  \n", "No tools needed.  \n", []),
    (HermesParser, "a <tool", "a <tool", []),
    (HermesParser, "x <b>y</b>", "x <b>y</b>", []),
    (
        HermesParser,
        '<tool_call>{"arguments": {"a": 1}, "name": "late"}</tool_call> done',
        "done",
        [("late", '{"a": 1}')],
    ),
    (
        Llama3JsonParser,
        '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2]}}; {"name": "g", "parameters": {}}',
        "",
        [("f", '{"a": [1, 2]}'), ("g", "{}")],
    ),
    (Llama3JsonParser, "  Hello {world}", "  Hello {world}", []),
    (Llama3JsonParser, "   ", "   ", []),
    (
        ForcedParser,
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}, {{"name": "now", "parameters": {{}}}}]',
        "",
        [("get_weather", WEATHER), ("now", "{}")],
    ),
    (lambda: NamedParser("f"), WEATHER, "", [("f", WEATHER)]),
]


@pytest.mark.parametrize(("make", "text", "content", "calls"), CASES)
def test_known_texts(make: Callable[[], ToolParser], text: str, content: str, calls: Calls) -> None:
    got_content, got_calls, errors = run(make, [text])
    assert (got_content, got_calls, errors) == (content, calls, 0)
    for size in (1, 2, 3, 7):  # and in small fixed pieces
        assert run(make, [text[i : i + size] for i in range(0, len(text), size)]) == (content, calls, 0)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_any_chunking_of_a_known_text(case: tuple[Any, str, str, Calls], cuts: list[int]) -> None:
    make, text, content, calls = case
    assert run(make, chunked(text, cuts)) == (content, calls, 0)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-100, 100) | st.text("ab }{][\"\\,:'\n", max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text('xyz"{', max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
NAME = st.text("abcdefgh_", min_size=1, max_size=8)
CONTENT = st.text("ab <>/tolcx\n {}", max_size=12)  # no "_": it cannot spell a tag, only start one


@st.composite
def hermes_text(draw: st.DrawFn) -> tuple[str, Calls]:
    parts: list[str] = []
    calls: Calls = []
    for _ in range(draw(st.integers(0, 3))):
        parts.append(draw(CONTENT))
        args = json.dumps(draw(st.dictionaries(st.text("xy", max_size=2), JSON, max_size=3)))
        name = draw(NAME)
        gap = draw(st.sampled_from(["", "\n", " "]))
        parts.append(f'<tool_call>{gap}{{"name": "{name}", "arguments": {args}}}{gap}</tool_call>')
        calls.append((name, args))
    parts.append(draw(CONTENT))
    return "".join(parts), calls


@settings(max_examples=300, deadline=None)
@given(case=hermes_text(), cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_hermes_any_chunking_of_generated_text(case: tuple[str, Calls], cuts: list[int]) -> None:
    text, calls = case
    whole = run(HermesParser, [text])
    assert run(HermesParser, chunked(text, cuts)) == whole
    assert whole[1] == calls and whole[2] == 0


@settings(max_examples=200, deadline=None)
@given(
    args=st.lists(
        st.tuples(NAME, st.dictionaries(st.text("xy", max_size=2), JSON, max_size=3)), min_size=1, max_size=3
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_forced_and_llama3_any_chunking(args: list[tuple[str, dict[str, Any]]], cuts: list[int]) -> None:
    calls = [(name, json.dumps(a)) for name, a in args]
    forced = "[" + ", ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls) + "]"
    assert run(ForcedParser, chunked(forced, cuts)) == ("", calls, 0)
    llama = "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls)
    assert run(Llama3JsonParser, chunked(llama, cuts)) == ("", calls, 0)


def test_a_call_cut_short_is_an_error_and_streams_what_it_had() -> None:
    content, calls, errors = run(HermesParser, ['<tool_call>{"name": "f", "arguments": {"a": '])
    assert (content, calls, errors) == ("", [("f", '{"a": ')], 1)
    assert run(ForcedParser, ['[{"name": "f", "parameters": {"a"'])[2] == 1
