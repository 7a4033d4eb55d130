"""The unmodified ``openai`` SDK against a real server (AsyncOpenAI runs on trio through anyio)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import trio

from ._support import CHAT_MESSAGES, request_json, sdk_client
from .conftest import ALIAS, MAX_MODEL_LEN, MODEL, ServerProcess


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk_client(server.url, timeout=30.0) as sdk:
        yield sdk


async def tokenize_count(server: ServerProcess, payload: dict[str, Any]) -> int:
    status, body = await request_json(server.host, server.port, "POST", "/tokenize", payload)
    assert status == 200, body
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    return int(body["count"])


def extra(choice_or_response: Any) -> dict[str, Any]:
    """Fields the SDK does not model (vLLM extensions such as ``token_ids``)."""
    return dict(choice_or_response.model_extra or {})


async def chat_text(client: openai.AsyncOpenAI, **kw: Any) -> tuple[str, list[int]]:
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", CHAT_MESSAGES)
    kw.setdefault("max_tokens", 12)
    body = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    response = await client.chat.completions.create(**kw, extra_body=body)
    choice = response.choices[0]
    return choice.message.content or "", extra(choice)["token_ids"]


# ---- chat ----------------------------------------------------------------------------------------


async def test_chat_non_stream(client: openai.AsyncOpenAI, server: ServerProcess) -> None:
    response = await client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == MODEL
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert response.usage is not None
    assert response.usage.completion_tokens == 7
    assert response.usage.prompt_tokens == await tokenize_count(server, {"messages": CHAT_MESSAGES})
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7


async def test_chat_stream_with_usage(client: openai.AsyncOpenAI, server: ServerProcess) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT_MESSAGES,
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = [chunk async for chunk in stream]
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == []
    assert last.usage is not None
    assert all(c.usage is None for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    ids = [t for c in body for t in extra(c.choices[0]).get("token_ids") or []]
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert body[-1].choices[0].finish_reason == "length"
    assert len(ids) == 9
    assert last.usage.completion_tokens == 9
    assert last.usage.prompt_tokens == await tokenize_count(server, {"messages": CHAT_MESSAGES})
    assert last.usage.total_tokens == last.usage.prompt_tokens + 9
    # The streamed text is the text of the streamed token ids.
    status, detok = await request_json(server.host, server.port, "POST", "/detokenize", {"tokens": ids})
    assert status == 200
    if "\ufffd" not in detok["prompt"]:  # a split multi-byte character is dropped, by design
        assert text == detok["prompt"]


async def test_chat_stream_without_usage_has_no_usage_chunk(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, max_tokens=3, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_streamed_and_full_responses_agree(client: openai.AsyncOpenAI) -> None:
    full_text, full_ids = await chat_text(client, seed=4242, max_tokens=15)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT_MESSAGES,
        max_tokens=15,
        seed=4242,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    ids = [t for c in chunks for t in extra(c.choices[0]).get("token_ids") or []]
    assert ids == full_ids
    assert text == full_text


async def test_max_completion_tokens(client: openai.AsyncOpenAI) -> None:
    response = await client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, max_completion_tokens=5, extra_body={"ignore_eos": True}
    )
    assert response.usage is not None
    assert response.usage.completion_tokens == 5
    assert response.choices[0].finish_reason == "length"


async def test_model_alias_is_echoed(client: openai.AsyncOpenAI) -> None:
    response = await client.chat.completions.create(
        model=ALIAS, messages=CHAT_MESSAGES, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert response.model == ALIAS


def _sync_round_trip(base_url: str) -> tuple[str, int, list[str]]:
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30.0) as sdk:
        full = sdk.chat.completions.create(
            model=MODEL, messages=CHAT_MESSAGES, max_tokens=4, seed=11, extra_body={"ignore_eos": True}
        )
        stream = sdk.chat.completions.create(
            model=MODEL, messages=CHAT_MESSAGES, max_tokens=4, seed=11, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert full.usage is not None
    return full.choices[0].message.content or "", full.usage.completion_tokens, deltas


async def test_sync_client_in_a_thread(server: ServerProcess, client: openai.AsyncOpenAI) -> None:
    text, completion_tokens, deltas = await trio.to_thread.run_sync(_sync_round_trip, f"{server.url}/v1")
    assert completion_tokens == 4
    assert "".join(deltas) == text
    async_text, _ = await chat_text(client, seed=11, max_tokens=4)
    assert async_text == text


# ---- completions -----------------------------------------------------------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog"


async def test_completions_non_stream(client: openai.AsyncOpenAI, server: ServerProcess) -> None:
    response = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert len(extra(choice)["token_ids"]) == 6
    prompt_ids = extra(response)["prompt_token_ids"]
    status, tok = await request_json(server.host, server.port, "POST", "/tokenize", {"prompt": PROMPT})
    assert status == 200
    assert prompt_ids == tok["tokens"]
    assert response.usage is not None
    assert response.usage.prompt_tokens == tok["count"]
    assert response.usage.completion_tokens == 6


async def test_completions_stream_with_usage(client: openai.AsyncOpenAI, server: ServerProcess) -> None:
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = [chunk async for chunk in stream]
    *body, last = chunks
    assert all(c.object == "text_completion" for c in chunks)
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == await tokenize_count(server, {"prompt": PROMPT})
    assert sum(len(extra(c.choices[0]).get("token_ids") or []) for c in body) == 8
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]


async def test_completions_default_max_tokens_is_16(client: openai.AsyncOpenAI) -> None:
    response = await client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True})
    assert response.usage is not None
    assert response.usage.completion_tokens == 16
    assert response.choices[0].finish_reason == "length"


async def test_completions_token_id_prompt(client: openai.AsyncOpenAI) -> None:
    response = await client.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert response.usage is not None
    assert response.usage.prompt_tokens == 5
    assert response.usage.completion_tokens == 3


# ---- n ---------------------------------------------------------------------------------------------


async def test_n3_non_stream(client: openai.AsyncOpenAI) -> None:
    response = await client.chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, max_tokens=4, n=3, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage is not None
    assert response.usage.completion_tokens == 12


async def test_n3_stream(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    per_index: dict[int, int] = {}
    finishes: dict[int, list[str]] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ids = extra(choice).get("token_ids") or []
            per_index[choice.index] = per_index.get(choice.index, 0) + len(ids)
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert per_index == {0: 5, 1: 5, 2: 5}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    assert usage is not None
    assert usage.completion_tokens == 15


# ---- seeds -----------------------------------------------------------------------------------------


async def test_seed_reproducible(client: openai.AsyncOpenAI) -> None:
    a = await chat_text(client, seed=1234)
    b = await chat_text(client, seed=1234)
    c = await chat_text(client, seed=9876)
    assert a == b
    assert a[1] != c[1]  # 12 tokens from a 32000 vocabulary: a collision means the seed is ignored
    first = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=77)
    second = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=77)
    assert first.choices[0].text == second.choices[0].text


async def test_seed_with_n_reproducible_and_distinct(client: openai.AsyncOpenAI) -> None:
    async def run() -> list[str]:
        response = await client.chat.completions.create(
            model=MODEL, messages=CHAT_MESSAGES, max_tokens=10, n=3, seed=555, extra_body={"ignore_eos": True}
        )
        return [c.message.content or "" for c in sorted(response.choices, key=lambda c: c.index)]

    first, second = await run(), await run()
    assert first == second
    assert len(set(first)) == 3


# ---- stop --------------------------------------------------------------------------------------------


def pick_stop(text: str) -> str:
    """A 3-character piece of ``text`` from its middle, without whitespace."""
    for start in range(len(text) // 3, len(text) - 3):
        piece = text[start : start + 3]
        if piece.strip() == piece and " " not in piece and "\ufffd" not in piece:
            return piece
    pytest.skip(f"no usable stop string in {text!r}")


async def test_stop_string_truncates_non_stream(client: openai.AsyncOpenAI) -> None:
    original, _ = await chat_text(client, seed=31337, max_tokens=30)
    stop = pick_stop(original)
    expected = original[: original.find(stop)]
    response = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT_MESSAGES,
        max_tokens=30,
        seed=31337,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in (choice.message.content or "")
    assert choice.message.content == expected
    assert extra(choice).get("stop_reason") == stop


async def test_stop_string_truncates_stream(client: openai.AsyncOpenAI) -> None:
    original, _ = await chat_text(client, seed=2718, max_tokens=30)
    stop = pick_stop(original)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT_MESSAGES,
        max_tokens=30,
        seed=2718,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    text = "".join(deltas)
    assert stop not in text
    assert text == original[: original.find(stop)]


async def test_include_stop_str_in_output(client: openai.AsyncOpenAI) -> None:
    original, _ = await chat_text(client, seed=1618, max_tokens=30)
    stop = pick_stop(original)
    response = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT_MESSAGES,
        max_tokens=30,
        seed=1618,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == original[: original.find(stop) + len(stop)]


async def test_stop_string_never_in_output(client: openai.AsyncOpenAI) -> None:
    stops = ["e", "\n"]
    response = await client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, n=4, stop=stops, extra_body={"ignore_eos": True}
    )
    for choice in response.choices:
        assert not any(s in choice.text for s in stops), choice.text
        assert choice.finish_reason in ("stop", "length")
    stream = await client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=40,
        n=4,
        stop=stops,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert len(texts) == 4
    for text in texts.values():
        assert not any(s in text for s in stops), text


async def test_stop_token_ids(client: openai.AsyncOpenAI) -> None:
    _, ids = await chat_text(client, seed=8080, max_tokens=12)
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    response = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT_MESSAGES,
        max_tokens=12,
        seed=8080,
        extra_body={"ignore_eos": True, "return_token_ids": True, "stop_token_ids": [ids[at]]},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert extra(choice).get("stop_reason") == ids[at]
    assert extra(choice)["token_ids"] == ids[: at + 1]
    assert response.usage is not None
    assert response.usage.completion_tokens == at + 1


# ---- models and errors ---------------------------------------------------------------------------


async def test_models_list(client: openai.AsyncOpenAI) -> None:
    page = await client.models.list()
    assert [m.id for m in page.data] == [MODEL, ALIAS]
    assert all(m.object == "model" for m in page.data)
    assert all(extra(m).get("max_model_len") == MAX_MODEL_LEN for m in page.data)


async def test_unknown_model_is_not_found(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="no-such-model", messages=CHAT_MESSAGES, max_tokens=2)
    assert info.value.status_code == 404
    assert "no-such-model" in info.value.message
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=2, stream=True)


async def test_max_tokens_too_large_is_bad_request(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=MAX_MODEL_LEN)
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict)
    assert info.value.body.get("param") == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10**9, stream=True)


async def test_other_bad_requests(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=2, n=99)
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=2, temperature=7)
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL, prompt="", max_tokens=2)
