"""frontend/request/structured.py: every way a request can ask for structured output becomes one
checked llguidance grammar, and every malformed or conflicting one is a 400 naming its parameter."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import msgspec
import pytest

from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import ChatCompletionRequest, CompletionRequest
from trioserve.frontend.request.structured import (
    MAX_SCHEMA_DEPTH,
    GrammarCache,
    GrammarSource,
    checked_grammar,
    grammar_source,
    refuse_beside_grammar,
)
from trioserve.protocol.messages import MAX_GRAMMAR_BYTES

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
USER = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [USER], **fields}, ChatCompletionRequest)


def completion(**fields: Any) -> CompletionRequest:
    return msgspec.convert({"prompt": "hi", **fields}, CompletionRequest)


def refused(req: ChatCompletionRequest | CompletionRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        source = grammar_source(req)
        assert source is not None
        refuse_beside_grammar(req, source)
        checked_grammar(GrammarCache(), source)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        (chat(response_format={"type": "text"}), None),
        (chat(), None),
        (chat(structured_outputs={"disable_fallback": True}), None),
        (
            chat(response_format={"type": "json_object"}),
            ("json_schema", '{"type": "object"}', "response_format"),
        ),
        (
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            ),
            ("json_schema", json.dumps(SCHEMA), "response_format"),
        ),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
            ("json_schema", '{"type": "object"}', "response_format"),
        ),
        (
            completion(structured_outputs={"json": SCHEMA}),
            ("json_schema", json.dumps(SCHEMA), "structured_outputs.json"),
        ),
        (
            completion(structured_outputs={"json": '{"type":"string"}'}),
            ("json_schema", '{"type":"string"}', "structured_outputs.json"),
        ),
        (
            chat(structured_outputs={"json_object": True}),
            ("json_schema", '{"type": "object"}', "structured_outputs.json_object"),
        ),
        (chat(structured_outputs={"regex": "a+"}), ("regex", "a+", "structured_outputs.regex")),
        (
            chat(structured_outputs={"choice": ["x", "y"]}),
            ("choice", '["x", "y"]', "structured_outputs.choice"),
        ),
        (
            chat(structured_outputs={"grammar": 'start: "a"'}),
            ("grammar", 'start: "a"', "structured_outputs.grammar"),
        ),
        (chat(guided_json=SCHEMA), ("json_schema", json.dumps(SCHEMA), "guided_json")),
        (completion(guided_regex="[0-9]+"), ("regex", "[0-9]+", "guided_regex")),
        (chat(guided_choice=["a", "b"]), ("choice", '["a", "b"]', "guided_choice")),
        (chat(guided_grammar='root ::= "a"'), ("grammar", 'root ::= "a"', "guided_grammar")),
    ],
)
def test_sources(
    req: ChatCompletionRequest | CompletionRequest, expected: tuple[str, str, str] | None
) -> None:
    source = grammar_source(req)
    assert source == (None if expected is None else GrammarSource(*expected))
    if source is not None:
        grammar = checked_grammar(GrammarCache(), source)
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""


@pytest.mark.parametrize(
    ("req", "param", "words"),
    [
        (chat(response_format={"type": "json"}), "response_format", "json_schema"),
        (chat(response_format={"type": "json_schema"}), "response_format", "json_schema"),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA, "x": 1}}),
            "response_format",
            "unknown",
        ),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"schema": 3}}),
            "response_format.json_schema.schema",
            "JSON schema",
        ),
        (chat(guided_json={"type": "objekt"}), "guided_json", "Invalid type"),
        (chat(guided_json='{"type": '), "guided_json", "cannot be used"),
        (chat(guided_regex="a(b"), "guided_regex", "unclosed group"),
        (chat(guided_regex=""), "guided_regex", "non-empty"),
        (chat(guided_choice=[]), "guided_choice", "non-empty list"),
        (chat(structured_outputs={"grammar": "start: foo"}), "structured_outputs.grammar", "unknown name"),
        (chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "one constraint"),
        (chat(structured_outputs={"json_object": 1}), "structured_outputs.json_object", "boolean"),
        (
            chat(structured_outputs={"whitespace_pattern": " *"}),
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        (chat(structured_outputs={"nope": 1}), "structured_outputs.nope", "unknown field"),
        (
            chat(guided_json=SCHEMA, response_format={"type": "json_object"}),
            "guided_json",
            "one output constraint",
        ),
        (chat(guided_json=SCHEMA, ignore_eos=True), "ignore_eos", "cannot be combined"),
        (chat(guided_regex="a", min_tokens=1), "min_tokens", "cannot be combined"),
        (
            chat(guided_json={"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}),
            "guided_json",
            "Unknown format",
        ),
    ],
)
def test_refusals_name_the_parameter(
    req: ChatCompletionRequest | CompletionRequest, param: str, words: str
) -> None:
    error = refused(req)
    assert error.param == param
    assert words in error.message


def test_too_large_and_too_deep() -> None:
    big = GrammarSource("regex", "a" * (MAX_GRAMMAR_BYTES + 1), "guided_regex")
    with pytest.raises(ApiError, match="too large"):
        checked_grammar(GrammarCache(), big)
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    assert "deeper" in refused(chat(guided_json=deep)).message


def test_the_cache_builds_each_source_once() -> None:
    cache = GrammarCache(size=2)
    a, b, c = (GrammarSource("regex", r, "guided_regex") for r in ("a+", "b+", "c+"))
    first = checked_grammar(cache, a)
    assert checked_grammar(cache, a) == first and cache.cached(a) == first
    checked_grammar(cache, b)
    checked_grammar(cache, c)  # evicts a, the least recently used
    assert cache.compiles == 3 and len(cache) == 2 and cache.cached(a) is None
    with pytest.raises(ApiError):
        checked_grammar(cache, GrammarSource("regex", "(", "guided_regex"))
    assert cache.cached(GrammarSource("regex", "(", "guided_regex")) is None  # a failure is not kept
