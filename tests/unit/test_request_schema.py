"""Every request field has an effect or a written reason why not, and nothing else is accepted.

``test_every_field_is_accounted_for`` walks the request schema: a field must appear in ``EFFECTS``
below (where its effect is implemented: the named function's source mentions the field) or in one of
``validate``'s tables (informational, or not supported yet with its neutral values). So no field can
be added without an effect or a documented reason. The parametrized tests check the validation
itself, without a server (tests/trio/test_request_validation.py sends the same requests over HTTP).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from trioserve.config import ModelConfig, RequestConfig
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from trioserve.frontend.request.validate import (
    INFORMATIONAL_FIELDS,
    MAX_JSON_DEPTH,
    UNSUPPORTED_FIELDS,
    decode_body,
    json_depth,
    output_options,
    sampling_params,
)
from trioserve.frontend.serving import message_dicts
from trioserve.frontend.text.stop_strings import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from trioserve.protocol.messages import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS

# Field path -> "module:qualified name" of the code that implements its effect.
_SAMPLING = {
    "model": "trioserve.frontend.request.validate:output_options",
    "stream": "trioserve.frontend.request.validate:output_options",
    "stream_options": "trioserve.frontend.request.validate:output_options",
    "stream_options.include_usage": "trioserve.frontend.request.validate:output_options",
    "stream_options.continuous_usage_stats": "trioserve.frontend.request.validate:output_options",
    "n": "trioserve.frontend.request.validate:output_options",
    "stop": "trioserve.frontend.request.validate:output_options",
    "include_stop_str_in_output": "trioserve.frontend.request.validate:output_options",
    "skip_special_tokens": "trioserve.frontend.request.validate:output_options",
    "return_token_ids": "trioserve.frontend.request.validate:output_options",
    "max_tokens": "trioserve.frontend.request.validate:requested_max_tokens",
    "temperature": "trioserve.frontend.request.validate:sampling_params",
    "top_p": "trioserve.frontend.request.validate:sampling_params",
    "top_k": "trioserve.frontend.request.validate:sampling_params",
    "seed": "trioserve.frontend.request.validate:sampling_params",
    "stop_token_ids": "trioserve.frontend.request.validate:sampling_params",
    "ignore_eos": "trioserve.frontend.request.validate:sampling_params",
    "min_tokens": "trioserve.frontend.request.validate:sampling_params",
    # The logits processors: carried to the worker's sampler (tests/unit/test_sampling_params.py).
    "presence_penalty": "trioserve.frontend.request.validate:sampling_params",
    "frequency_penalty": "trioserve.frontend.request.validate:sampling_params",
    "repetition_penalty": "trioserve.frontend.request.validate:sampling_params",
    "min_p": "trioserve.frontend.request.validate:sampling_params",
    "logit_bias": "trioserve.frontend.request.validate:sampling_params",
    "allowed_token_ids": "trioserve.frontend.request.validate:sampling_params",
    "bad_words": "trioserve.frontend.request.validate:bad_words_token_ids",
    **{
        name: "trioserve.frontend.request.structured:grammar_source"
        for name in (
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        )
    },
    "priority": "trioserve.frontend.serving:Serving._prepare",
    "timeout_ms": "trioserve.frontend.serving:Serving._prepare",
    "prompt_logprobs": "trioserve.frontend.request.validate:prompt_logprobs_count",
}
_MESSAGES = {
    "messages": "trioserve.frontend.serving:message_dicts",
    "messages[].role": "trioserve.frontend.serving:message_dicts",
    "messages[].content": "trioserve.frontend.serving:message_dicts",
    "messages[].content[].type": "trioserve.frontend.serving:message_dicts",
    "messages[].content[].text": "trioserve.frontend.serving:message_dicts",
    "messages[].name": "trioserve.frontend.serving:message_dicts",
    "messages[].tool_calls": "trioserve.frontend.serving:message_dicts",
    "messages[].tool_call_id": "trioserve.frontend.serving:message_dicts",
}
EFFECTS: dict[type, dict[str, str]] = {
    ChatCompletionRequest: {
        **_SAMPLING,
        **_MESSAGES,
        "max_completion_tokens": "trioserve.frontend.request.validate:requested_max_tokens",
        "add_generation_prompt": "trioserve.frontend.serving:Serving._chat_prompt",
        "chat_template_kwargs": "trioserve.frontend.serving:Serving._chat_prompt",
        "continue_final_message": "trioserve.frontend.serving:Serving._chat_prompt",
        "chat_template": "trioserve.frontend.serving:Serving._chat_prompt",
        "truncate_prompt_tokens": "trioserve.frontend.serving:Serving._chat_prompt",
        "logprobs": "trioserve.frontend.request.validate:logprobs_count",
        "top_logprobs": "trioserve.frontend.request.validate:logprobs_count",
        "tools": "trioserve.frontend.request.tools:tools_plan",
        "tool_choice": "trioserve.frontend.request.tools:tools_plan",
        "parallel_tool_calls": "trioserve.frontend.request.tools:tools_plan",
    },
    CompletionRequest: {
        **_SAMPLING,
        "prompt": "trioserve.frontend.serving:Serving._completion_prompts",
        "truncate_prompt_tokens": "trioserve.frontend.serving:Serving._completion_prompts",
        "logprobs": "trioserve.frontend.request.validate:logprobs_count",
        "echo": "trioserve.frontend.request.validate:prompt_logprobs_count",
    },
    TokenizeRequest: {
        **_MESSAGES,
        "model": "trioserve.frontend.edge.app:create_app",
        "prompt": "trioserve.frontend.edge.app:create_app",
        "add_special_tokens": "trioserve.frontend.edge.app:create_app",
        "add_generation_prompt": "trioserve.frontend.edge.app:create_app",
        "tools": "trioserve.frontend.edge.app:create_app",
    },
    DetokenizeRequest: {
        "model": "trioserve.frontend.edge.app:create_app",
        "tokens": "trioserve.frontend.edge.app:create_app",
    },
}


def _structs(t: mi.Type, suffix: str = "") -> Iterator[tuple[str, mi.StructType]]:
    """The structs inside a field's type, each with the path suffix that reaches it (``[]``: items)."""
    if isinstance(t, mi.StructType):
        yield suffix, t
    elif isinstance(t, mi.UnionType):
        for member in t.types:
            yield from _structs(member, suffix)
    elif isinstance(t, mi.ListType):
        yield from _structs(t.item_type, suffix + "[]")
    elif isinstance(t, mi.DictType):
        yield from _structs(t.value_type, suffix + "{}")
    elif isinstance(t, mi.Metadata):
        yield from _structs(t.type, suffix)


def _fields(struct: mi.StructType, prefix: str = "") -> Iterator[tuple[str, mi.StructType]]:
    """Every field path of a request, with the struct that declares it."""
    for f in struct.fields:
        path = prefix + f.name
        yield path, struct
        for suffix, nested in _structs(f.type):
            yield from _fields(nested, f"{path}{suffix}.")


def _source_mentions(where: str, name: str) -> bool:
    module_name, qualname = where.split(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return re.search(rf"\b{re.escape(name)}\b", inspect.getsource(obj)) is not None


@pytest.mark.parametrize("root", list(EFFECTS), ids=lambda r: r.__name__)
def test_every_field_is_accounted_for(root: type) -> None:
    effects = EFFECTS[root]
    seen = set()
    for path, struct in _fields(mi.type_info(root)):  # type: ignore[arg-type]
        seen.add(path)
        assert struct.forbid_unknown_fields, f"{struct.cls.__name__} must forbid unknown fields"
        tables = [
            name
            for name, table in (
                ("EFFECTS", effects),
                ("INFORMATIONAL_FIELDS", INFORMATIONAL_FIELDS),
                ("UNSUPPORTED_FIELDS", UNSUPPORTED_FIELDS),
            )
            if path in table
        ]
        assert len(tables) == 1, (
            f"{root.__name__}: `{path}` must be in exactly one of EFFECTS (with the code that implements "
            f"it), validate.INFORMATIONAL_FIELDS or validate.UNSUPPORTED_FIELDS (with the reason); "
            f"found in {tables}"
        )
        if path in effects:
            name = path.rsplit(".", 1)[-1]
            assert _source_mentions(effects[path], name), f"{effects[path]} never mentions `{name}`"
    stale = set(effects) - seen
    assert not stale, f"EFFECTS lists fields {root.__name__} does not have: {stale}"


def test_documented_fields_exist() -> None:
    every = {path for root in EFFECTS for path, _ in _fields(mi.type_info(root))}  # type: ignore[arg-type]
    assert not (set(INFORMATIONAL_FIELDS) | set(UNSUPPORTED_FIELDS)) - every
    assert all(entry.why and entry.accepts for entry in UNSUPPORTED_FIELDS.values())


# ---- the checks themselves, without a server -----------------------------------------------------

MODEL = ModelConfig(max_model_len=512)
LIMITS = RequestConfig()
USER = {"role": "user", "content": "hi"}


def validate(body: dict[str, Any], kind: str = "chat") -> None:
    """What ``Serving._prepare`` checks before and after rendering (with a 10-token prompt)."""
    raw = msgspec.json.encode(body)
    req: ChatCompletionRequest | CompletionRequest
    if kind == "chat":
        req = decode_body(raw, ChatCompletionRequest)
        output_options(req, MODEL, LIMITS)
        message_dicts(req.messages)
    else:
        req = decode_body(raw, CompletionRequest)
        output_options(req, MODEL, LIMITS)
    sampling_params(req, MODEL, 10)


def refused(body: dict[str, Any], kind: str = "chat") -> ApiError:
    with pytest.raises(ApiError) as info:
        validate(body, kind)
    assert info.value.status == 400
    return info.value


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [USER], "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


# (param named in the 400, endpoint, a body with an effect, bodies with none)
UNSUPPORTED_CASES: list[tuple[str, str, dict[str, Any], list[dict[str, Any]]]] = [
    ("best_of", "completion", completion(best_of=2), [completion(best_of=1), completion(best_of=2, n=2)]),
    ("suffix", "completion", completion(suffix="!"), [completion(suffix=""), completion(suffix=None)]),
    ("store", "chat", chat(store=True), [chat(store=False)]),
    (
        "service_tier",
        "chat",
        chat(service_tier="flex"),
        [chat(service_tier="auto"), chat(service_tier="default")],
    ),
    (
        "stream_options.include_obfuscation",
        "completion",
        completion(stream=True, stream_options={"include_obfuscation": True}),
        [completion(stream=True, stream_options={"include_obfuscation": False})],
    ),
    *[
        (
            f"messages[1].{name}",
            "chat",
            chat(messages=[USER, {"role": "assistant", "content": "ok", name: value}, USER]),
            [chat(messages=[USER, {"role": "assistant", "content": "ok", name: None}, USER])],
        )
        for name, value in [
            ("refusal", "no"),
            ("annotations", [{"type": "url_citation"}]),
            ("audio", {"id": "a"}),
            ("function_call", {"name": "f", "arguments": "{}"}),
        ]
    ],
    ("modalities", "chat", chat(modalities=["text", "audio"]), [chat(modalities=["text"])]),
]


def test_a_history_replayed_from_a_response_dump_is_accepted() -> None:
    """The openai SDK's ``message.model_dump()`` of a plain text answer, sent back as history."""
    dumped = {
        "role": "assistant",
        "content": "Paris.",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }
    validate(chat(messages=[USER, dumped, USER]))


@pytest.mark.parametrize(
    ("param", "kind", "body", "neutral"),
    UNSUPPORTED_CASES,
    ids=[f"{c[0]}-{c[1]}" for c in UNSUPPORTED_CASES],
)
def test_unsupported_parameters(param: str, kind: str, body: dict[str, Any], neutral: list[Any]) -> None:
    error = refused(body, kind)
    assert error.param == param
    assert f"`{param}`" in error.message or param in error.message
    for ok in neutral:
        validate(ok, kind)


def test_every_unsupported_field_has_a_case() -> None:
    covered = {re.sub(r"\[\d+\]", "[]", case[0]) for case in UNSUPPORTED_CASES}
    assert covered == set(UNSUPPORTED_FIELDS)


def test_informational_fields_are_accepted_at_any_value() -> None:
    validate(
        chat(
            user="u-1",
            safety_identifier="s",
            metadata={"k": "v"},
            prompt_cache_key="k",
        )
    )
    validate(completion(user="u-2"), "completion")
    assert set(INFORMATIONAL_FIELDS) == {
        "user",
        "safety_identifier",
        "metadata",
        "prompt_cache_key",
    }
    # OpenAI's bounds on metadata: 16 pairs, 64-character keys, 512-character values.
    assert refused(chat(metadata={str(i): "v" for i in range(17)})).param == "metadata"
    assert refused(chat(metadata={"k" * 65: "v"})).param == "metadata"


OUT_OF_RANGE: list[tuple[str, str, dict[str, Any]]] = [
    ("presence_penalty", "chat", chat(presence_penalty=5)),
    ("presence_penalty", "chat", chat(presence_penalty=-2.01)),
    ("frequency_penalty", "completion", completion(frequency_penalty=3)),
    ("repetition_penalty", "chat", chat(repetition_penalty=0)),
    ("repetition_penalty", "chat", chat(repetition_penalty=-1)),
    ("min_p", "chat", chat(min_p=2)),
    ("min_p", "chat", chat(min_p=-0.1)),
    ("logit_bias", "chat", chat(logit_bias={"5": 500})),
    ("logit_bias", "chat", chat(logit_bias={"5": -100.5})),
    ("logit_bias", "chat", chat(logit_bias={str(i): 1 for i in range(301)})),
    ("logit_bias", "chat", chat(logit_bias={"abc": 1})),  # keys are token ids
    ("logit_bias", "chat", chat(logit_bias={"-3": 1})),
    ("logit_bias", "chat", chat(logit_bias={str(MODEL.vocab_size): 1})),  # past the vocabulary
    ("min_p", "completion", completion(min_p=1.5)),
    ("allowed_token_ids", "chat", chat(allowed_token_ids=[])),
    ("allowed_token_ids", "completion", completion(allowed_token_ids=[1, MODEL.vocab_size])),
    ("allowed_token_ids[0]", "chat", chat(allowed_token_ids=[-1])),
    ("allowed_token_ids", "chat", chat(allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS + 1)))),
    ("bad_words", "completion", completion(bad_words=["ok", ""])),
    ("bad_words", "chat", chat(bad_words=["  "])),
    ("bad_words", "chat", chat(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS + 1)])),
    ("top_logprobs", "chat", chat(top_logprobs=21)),
    ("top_logprobs", "chat", chat(top_logprobs=3, logprobs=False)),  # OpenAI: needs logprobs true
    ("logprobs", "completion", completion(logprobs=-1)),
    ("logprobs", "completion", completion(logprobs=21)),
    ("prompt_logprobs", "completion", completion(prompt_logprobs=-1)),
    ("best_of", "completion", completion(best_of=1, n=2)),
    ("truncate_prompt_tokens", "completion", completion(truncate_prompt_tokens=-2)),
    ("truncate_prompt_tokens", "chat", chat(truncate_prompt_tokens=MODEL.max_model_len + 1)),  # vLLM's bound
    ("continue_final_message", "chat", chat(continue_final_message=True)),  # with add_generation_prompt
    ("stop", "chat", chat(stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)])),
    ("stop", "chat", chat(stop="x" * (MAX_STOP_STRING_CHARS + 1))),
    ("stop", "completion", completion(stop=["ok", "y" * (MAX_STOP_STRING_CHARS + 1)])),
]


@pytest.mark.parametrize(("param", "kind", "body"), OUT_OF_RANGE, ids=[c[0] for c in OUT_OF_RANGE])
def test_out_of_range_values(param: str, kind: str, body: dict[str, Any]) -> None:
    error = refused(body, kind)
    assert error.param == param
    assert "not supported" not in error.message  # a range error, even though the feature is missing


def _logprobs_asked(
    body: dict[str, Any], kind: str, limits: RequestConfig = LIMITS
) -> tuple[int | None, int | None]:
    raw = msgspec.json.encode(body)
    req: ChatCompletionRequest | CompletionRequest = decode_body(
        raw, ChatCompletionRequest if kind == "chat" else CompletionRequest
    )
    options = output_options(req, MODEL, limits)
    return options.logprobs, sampling_params(req, MODEL, 10).logprobs


def test_logprobs_reach_the_engine() -> None:
    assert _logprobs_asked(chat(), "chat") == (None, None)
    assert _logprobs_asked(chat(logprobs=False, top_logprobs=0), "chat") == (None, None)
    assert _logprobs_asked(chat(logprobs=True), "chat") == (0, 0)
    assert _logprobs_asked(chat(logprobs=True, top_logprobs=20), "chat") == (20, 20)  # the cap, inclusive
    assert _logprobs_asked(completion(), "completion") == (None, None)
    assert _logprobs_asked(completion(logprobs=0), "completion") == (0, 0)  # the sampled token's own
    assert _logprobs_asked(completion(logprobs=5), "completion") == (5, 5)


def test_max_logprobs_is_the_cap() -> None:
    limits = RequestConfig(max_logprobs=3)
    assert _logprobs_asked(chat(logprobs=True, top_logprobs=3), "chat", limits) == (3, 3)
    for body, kind, param in [
        (chat(logprobs=True, top_logprobs=4), "chat", "top_logprobs"),
        (completion(logprobs=4), "completion", "logprobs"),
    ]:
        with pytest.raises(ApiError) as info:
            _logprobs_asked(body, kind, limits)
        assert info.value.status == 400 and info.value.param == param and "[0, 3]" in info.value.message


def test_stop_caps_are_inclusive() -> None:
    validate(chat(stop=[str(i) for i in range(MAX_STOP_STRINGS)]))
    validate(chat(stop="x" * MAX_STOP_STRING_CHARS))


UNKNOWN: list[tuple[str, str, dict[str, Any]]] = [
    ("foo", "chat", chat(foo=1)),
    ("functions", "chat", chat(functions=[])),
    ("use_beam_search", "completion", completion(use_beam_search=False)),
    ("stream_options.bogus", "chat", chat(stream=True, stream_options={"bogus": True})),
    ("messages[0].reasoning_content", "chat", chat(messages=[{**USER, "reasoning_content": None}])),
    (
        "messages[0].content[0].cache_control",
        "chat",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}]),
    ),
]


@pytest.mark.parametrize(("param", "kind", "body"), UNKNOWN, ids=[c[0] for c in UNKNOWN])
def test_unknown_fields_are_refused(param: str, kind: str, body: dict[str, Any]) -> None:
    error = refused(body, kind)
    assert error.param == param
    assert f"`{param}`" in error.message


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (TokenizeRequest, {"prompt": "x", "return_token_strs": True}),
        (DetokenizeRequest, {"tokens": [1], "x": 1}),
    ],
)
def test_tokenize_routes_refuse_unknown_fields(kind: type, body: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as info:
        decode_body(msgspec.json.encode(body), kind)
    assert info.value.status == 400 and info.value.param in ("return_token_strs", "x")


def test_type_errors_name_the_field() -> None:
    assert refused(chat(max_tokens="ten")).param == "max_tokens"
    assert refused(chat(logit_bias={"5": "high"})).param == "logit_bias"
    assert refused(chat(messages=[{"role": 1, "content": "x"}])).param == "messages[0].role"
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    error = refused(image)
    assert error.param == "messages[0].content[0].type" and "only text" in error.message


# ---- message content (OpenAI's rule) --------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": []}],
        [{"role": "system"}, USER],
        [{"role": "developer", "content": None}, USER],
        [USER, {"role": "assistant"}, USER],
        [USER, {"role": "tool"}],
    ],
    ids=["user", "user-null", "user-no-parts", "system", "developer", "assistant", "tool"],
)
def test_a_message_without_content_is_refused(messages: list[dict[str, Any]]) -> None:
    error = refused(chat(messages=messages))
    index = next(i for i, m in enumerate(messages) if not m.get("content"))
    assert error.param == f"messages[{index}].content"
    assert "required" in error.message


def test_assistant_without_content_but_with_tool_calls_meets_the_content_rule() -> None:
    # OpenAI accepts it; a malformed call is refused for its shape, never for the missing content.
    message = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}
    assert refused(chat(messages=[USER, message, USER])).param == "messages[1].tool_calls[0]"
    good = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    req = decode_body(
        msgspec.json.encode(chat(messages=[USER, {"role": "assistant", "tool_calls": [good]}])),
        ChatCompletionRequest,
    )
    assert message_dicts(req.messages)[1] == {"role": "assistant", "content": None, "tool_calls": [good]}


def test_empty_string_content_is_content() -> None:
    validate(chat(messages=[{"role": "system", "content": ""}, USER]))


def test_message_dicts_give_templates_plain_dicts() -> None:
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}], "name": "ann"}, USER])
    req = decode_body(msgspec.json.encode(body), ChatCompletionRequest)
    assert message_dicts(req.messages) == [
        {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "ann"},
        {"role": "user", "content": "hi"},
    ]


# ---- nesting ----------------------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 1000, 20_000])
def test_deep_chat_template_kwargs_is_a_400(depth: int) -> None:
    body = b'{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":%b}}' % nested(depth)
    with pytest.raises(ApiError) as info:
        req = decode_body(body, ChatCompletionRequest)
        output_options(req, MODEL, LIMITS)
    assert info.value.status == 400 and "nested" in info.value.message


def test_shallow_chat_template_kwargs_is_accepted() -> None:
    depth = MAX_JSON_DEPTH - 2  # the kwargs dict and the dict around the lists count too
    kwargs = b'{"a":{"b":%b}}' % nested(depth)
    body = b'{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":%b}' % kwargs
    output_options(decode_body(body, ChatCompletionRequest), MODEL, LIMITS)


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages":[{"role":"user","content":[{"type":"text","text":"x","deep":%b}]}]}',
        b'{"messages":[{"role":"user","content":[%b]}]}',
        b'{"messages":[{"role":"assistant","content":"x","tool_calls":[{"f":%b}]}]}',
        b'{"messages":[{"role":"user","content":"x"}],"response_format":{"a":%b}}',
    ],
    ids=["part-unknown-field", "parts", "tool-calls", "response-format"],
)
def test_deep_nesting_anywhere_is_a_400(body: bytes) -> None:
    with pytest.raises(ApiError) as info:
        req = decode_body(body % nested(20_000), ChatCompletionRequest)
        output_options(req, MODEL, LIMITS)
        message_dicts(req.messages)
    assert info.value.status == 400


def test_json_depth() -> None:
    assert json_depth(1, 5) == 0
    assert json_depth({}, 5) == 1
    assert json_depth({"a": [1, {"b": []}]}, 5) == 4
    assert json_depth(msgspec.json.decode(nested(100)), 5) == 6  # stops counting past the limit
