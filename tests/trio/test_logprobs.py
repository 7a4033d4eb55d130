"""Logprobs end to end on the in-process stack (MockClock; the mock engine makes them up, consistently):
OpenAI's chat and completions shapes, streamed and not, ``n > 1`` and several prompts, tokens that
are part of a UTF-8 character, stop strings, merged deltas for a slow client, and the 400s."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, Stack, start_stack
from tests.trio.http_client import Reply
from trioserve.config import override
from trioserve.frontend.text.tokenizer import Tokenizer
from trioserve.mock.core import MockCore
from trioserve.protocol.messages import AddRequest, SamplingParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Tell me a story."}]


def chat(max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True, **extra}


def completion(prompt: Any = "Once upon", max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True, **extra}


def _token(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def check_chat_entry(tokenizer: Tokenizer, entry: dict[str, Any], token_id: int, k: int) -> None:
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert (entry["token"], entry["bytes"]) == _token(tokenizer, token_id)
    assert entry["logprob"] < 0
    top = entry["top_logprobs"]
    assert len(top) == k and all(set(t) == {"token", "logprob", "bytes"} for t in top)
    values = [t["logprob"] for t in top]
    assert values == sorted(values, reverse=True)
    for t in top:
        assert t["token"] == bytes(t["bytes"]).decode("utf-8", errors="replace")


def chat_stream_tokens(reply: Reply) -> dict[int, tuple[list[int], list[dict[str, Any]]]]:
    """Per choice: its token ids and logprobs entries, from the content chunks, which must carry one
    entry per token of their own delta."""
    out: dict[int, tuple[list[int], list[dict[str, Any]]]] = defaultdict(lambda: ([], []))
    for chunk in reply.chunks:
        for choice in chunk["choices"]:
            if "token_ids" not in choice:
                assert choice["logprobs"] is None  # the role chunk
                continue
            entries = choice["logprobs"]["content"]
            assert len(entries) == len(choice["token_ids"])
            out[choice["index"]][0].extend(choice["token_ids"])
            out[choice["index"]][1].extend(entries)
    return out


async def test_chat_logprobs_full_response(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    reply = await (await stack.client()).request(CHAT, chat(logprobs=True, top_logprobs=3, n=2, seed=4))
    assert reply.status == 200, reply.body
    choices = reply.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["token_ids"]) == 6
        for entry, token_id in zip(content, choice["token_ids"], strict=True):
            check_chat_entry(tokenizer, entry, token_id, 3)
    # top_logprobs 0 (or unset): each token's own logprob and no alternatives.
    reply = await (await stack.client()).request(CHAT, chat(logprobs=True))
    content = reply.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(e["top_logprobs"] == [] for e in content)
    # Not asked: no logprobs at all.
    reply = await (await stack.client()).request(CHAT, chat(logprobs=False, top_logprobs=0))
    assert "logprobs" not in reply.json()["choices"][0]


async def test_chat_logprobs_streamed(stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    body = chat(8, logprobs=True, top_logprobs=2, n=2, stream=True, seed=1)
    reply = await (await stack.client()).request(CHAT, body)
    assert reply.status == 200
    per_choice = chat_stream_tokens(reply)
    assert sorted(per_choice) == [0, 1]
    for ids, entries in per_choice.values():
        assert len(ids) == 8
        for entry, token_id in zip(entries, ids, strict=True):
            check_chat_entry(tokenizer, entry, token_id, 2)
    # The same seed without streaming: the same logprobs.
    full = await (await stack.client()).request(CHAT, {**body, "stream": False})
    assert full.json()["choices"][0]["logprobs"]["content"] == per_choice[0][1]
    # A plain stream still says "logprobs": null on every chunk.
    plain = await (await stack.client()).request(CHAT, chat(3, stream=True))
    assert all(c["logprobs"] is None for chunk in plain.chunks if chunk["choices"] for c in chunk["choices"])


def check_completion_logprobs(
    tokenizer: Tokenizer, logprobs: dict[str, Any], ids: list[int], k: int, offset: int = 0
) -> int:
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert logprobs["tokens"] == [_token(tokenizer, t)[0] for t in ids]
    assert all(lp < 0 for lp in logprobs["token_logprobs"])
    assert all(len(top) <= k and all(v < 0 for v in top.values()) for top in logprobs["top_logprobs"])
    assert sum(len(top) for top in logprobs["top_logprobs"]) > 0 or k == 0
    for token, start in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert start == offset
        offset += len(token)
    return offset


async def test_completion_logprobs_several_prompts(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    prompts = ["Hello there", "x", "Count: one two"]
    for k in (0, 4):
        reply = await (await stack.client()).request(
            COMPLETIONS, completion(prompts, logprobs=k, n=2, seed=9)
        )
        assert reply.status == 200, reply.body
        choices = reply.json()["choices"]
        assert [c["index"] for c in choices] == list(range(6))
        for choice in choices:
            check_completion_logprobs(tokenizer, choice["logprobs"], choice["token_ids"], k)
            if k == 0:
                assert choice["logprobs"]["top_logprobs"] == [{}] * 6


async def test_completion_logprobs_streamed(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    body = completion(["a b", "c"], 7, logprobs=2, n=2, stream=True, seed=2)
    reply = await (await stack.client()).request(COMPLETIONS, body)
    offsets: dict[int, int] = defaultdict(int)
    ids: dict[int, list[int]] = defaultdict(list)
    for chunk in reply.content_events():
        for choice in chunk["choices"]:
            index = choice["index"]
            assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])
            # text_offset runs on across the chunks of a choice.
            offsets[index] = check_completion_logprobs(
                tokenizer, choice["logprobs"], choice["token_ids"], 2, offsets[index]
            )
            ids[index] += choice["token_ids"]
    assert sorted(ids) == [0, 1, 2, 3] and all(len(v) == 7 for v in ids.values())
    full = await (await stack.client()).request(COMPLETIONS, {**body, "stream": False})
    for choice in full.json()["choices"]:
        assert choice["token_ids"] == ids[choice["index"]]
        assert choice["logprobs"]["text_offset"][-1] < offsets[choice["index"]]


def _partial(tokenizer: Tokenizer, token_id: int) -> bool:
    try:
        tokenizer.token_bytes(token_id).decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _seed_with_partial_tokens(tokenizer: Tokenizer, vocab: int, k: int, tokens: int) -> int:
    """A seed whose mock tokens (with logprobs on, which draw from the same RNG) include some whose
    bytes are not UTF-8 on their own."""
    for seed in range(2000):
        core = MockCore(vocab_size=vocab, max_num_seqs=1, max_model_len=512)
        core.add(AddRequest("r", [1, 2], SamplingParams(tokens, seed=seed, logprobs=k, ignore_eos=True), 0.0))
        ids = []
        while core.schedule() is not None:
            ids += [t for outs in core.update().values() for o in outs for t in o.new_token_ids]
        if sum(_partial(tokenizer, t) for t in ids) >= 2:
            return seed
    raise AssertionError("no seed gives partial UTF-8 tokens")


async def test_partial_utf8_tokens_keep_their_raw_bytes(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    vocab = stack.engine.core.vocab_size  # type: ignore[attr-defined]
    seed = _seed_with_partial_tokens(tokenizer, vocab, 1, 40)
    reply = await (await stack.client()).request(CHAT, chat(40, logprobs=True, top_logprobs=1, seed=seed))
    choice = reply.json()["choices"][0]
    partial = 0
    for entry, token_id in zip(choice["logprobs"]["content"], choice["token_ids"], strict=True):
        raw = tokenizer.token_bytes(token_id)
        assert bytes(entry["bytes"]) == raw  # the token's own bytes, byte for byte
        if _partial(tokenizer, token_id):
            partial += 1
            assert "\ufffd" in entry["token"]  # vLLM's string for bytes that are no text alone
    assert partial >= 2
    # Every token's bytes together are the completion's text.
    joined = b"".join(bytes(e["bytes"]) for e in choice["logprobs"]["content"])
    assert joined.decode("utf-8", errors="replace").startswith(choice["message"]["content"])


async def test_stop_string_drops_the_logprobs_it_cuts(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    first = await (await stack.client()).request(CHAT, chat(30, logprobs=True, seed=3))
    content = first.json()["choices"][0]["logprobs"]["content"]
    k = next(i for i in range(10, 30) if content[i]["token"].strip() and "\ufffd" not in content[i]["token"])
    stop = content[k]["token"].strip()
    cut = next(i for i, e in enumerate(content) if stop in "".join(x["token"] for x in content[: i + 1]))
    for stream in (False, True):
        reply = await (await stack.client()).request(
            CHAT, chat(30, logprobs=True, seed=3, stop=[stop], stream=stream)
        )
        if stream:
            entries = [e for c in reply.content_events() for e in c["choices"][0]["logprobs"]["content"]]
        else:
            entries = reply.json()["choices"][0]["logprobs"]["content"]
        # Up to and including the token that completes the stop string; none after it.
        assert entries == content[: cut + 1]


async def test_merged_deltas_merge_their_logprobs(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    tokens = 200
    async with trio.open_nursery() as nursery:
        stack = await start_stack(nursery, tokenizer, override(BASE_CONFIG, stream_policy="merge"))
        slow = await stack.client(rcvbuf=4096)
        await slow.send_request(CHAT, chat(tokens, logprobs=True, top_logprobs=2, stream=True, seed=5))
        reply = await slow.read_body(await slow.read_head(), max_events=3)
        await trio.sleep(0.6)  # 60 steps without reading: deltas merge
        await slow.read_body(reply)
        nursery.cancel_scope.cancel()
    per_event = [len(c["choices"][0]["token_ids"]) for c in reply.content_events()]
    assert sum(per_event) == tokens and max(per_event) > 1
    ids, entries = chat_stream_tokens(reply)[0]  # checks one entry per token in every chunk
    assert [e["token"] for e in entries] == [_token(tokenizer, t)[0] for t in ids]


async def test_echo_puts_the_prompt_first(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    prompts = ["Hello there, stop", "A b"]
    texts = prompts
    # Without logprobs: the text only; the prompt is not stop-checked (it holds the stop string).
    reply = await (await stack.client()).request(
        COMPLETIONS, completion(prompts, echo=True, n=2, stop=["stop"])
    )
    assert reply.status == 200, reply.body
    for choice in reply.json()["choices"]:
        prompt = texts[choice["index"] // 2]
        assert choice["text"].startswith(prompt)
        assert "logprobs" not in choice
    # With logprobs: the prompt's tokens first, the first with null logprobs.
    reply = await (await stack.client()).request(
        COMPLETIONS, completion(prompts, 3, echo=True, logprobs=2, n=2)
    )
    for choice in reply.json()["choices"]:
        prompt_ids = tokenizer.encode(prompts[choice["index"] // 2])
        ids = prompt_ids + choice["token_ids"]
        lp = choice["logprobs"]
        assert lp["tokens"] == [_token(tokenizer, t)[0] for t in ids]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(v < 0 for v in lp["token_logprobs"][1:])
        assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"][len(prompt_ids)] == len(
            "".join(lp["tokens"][: len(prompt_ids)])
        )
        assert choice["text"].startswith(texts[choice["index"] // 2])
    # Token ids: their text, decoded.
    reply = await (await stack.client()).request(COMPLETIONS, completion([9707, 1052], echo=True))
    assert reply.json()["choices"][0]["text"].startswith(tokenizer.decode([9707, 1052]))


async def test_echo_streamed(stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    body = completion("Once upon a time", 4, echo=True, logprobs=1, n=2, stream=True, seed=6)
    reply = await (await stack.client()).request(COMPLETIONS, body)
    prompt_ids = tokenizer.encode("Once upon a time")
    first: dict[int, dict[str, Any]] = {}
    text: dict[int, str] = defaultdict(str)
    tokens: dict[int, list[str]] = defaultdict(list)
    for chunk in reply.content_events():
        for choice in chunk["choices"]:
            first.setdefault(choice["index"], choice)
            text[choice["index"]] += choice["text"]
            tokens[choice["index"]] += choice["logprobs"]["tokens"]
    assert sorted(first) == [0, 1]
    full = await (await stack.client()).request(COMPLETIONS, {**body, "stream": False})
    for index, choice in first.items():
        assert choice["text"].startswith("Once upon a time")
        assert len(choice["logprobs"]["tokens"]) == len(prompt_ids) + len(choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"][0] is None
        whole = full.json()["choices"][index]
        assert whole["text"] == text[index] and whole["logprobs"]["tokens"] == tokens[index]


def check_prompt_logprobs(tokenizer: Tokenizer, entries: list[Any], prompt: list[int], k: int) -> None:
    """vLLM's shape: per prompt token null (the first) or {token id: {logprob, rank, decoded_token}}
    with the token itself and up to k alternatives."""
    assert len(entries) == len(prompt) and entries[0] is None
    for entry, token_id in zip(entries[1:], prompt[1:], strict=True):
        assert str(token_id) in entry and len(entry) <= k + 1
        own = entry[str(token_id)]
        assert (
            own["decoded_token"] == _token(tokenizer, token_id)[0] and own["rank"] >= 1 and own["logprob"] < 0
        )
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert value["decoded_token"] == _token(tokenizer, int(key))[0]


async def test_prompt_logprobs(stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    prompts = ["Hello there", "Count: one two three"]
    reply = await (await stack.client()).request(COMPLETIONS, completion(prompts, prompt_logprobs=2, n=2))
    assert reply.status == 200, reply.body
    for choice in reply.json()["choices"]:
        prompt = tokenizer.encode(prompts[choice["index"] // 2])
        check_prompt_logprobs(tokenizer, choice["prompt_logprobs"], prompt, 2)
        assert "logprobs" not in choice  # only the prompt's were asked for
    # Chat: the response's, where vLLM puts them; 0: each token's own only.
    reply = await (await stack.client()).request(CHAT, chat(prompt_logprobs=0))
    data = reply.json()
    prompt = data["prompt_token_ids"]
    check_prompt_logprobs(tokenizer, data["prompt_logprobs"], prompt, 0)
    assert all(e is None or len(e) == 1 for e in data["prompt_logprobs"])
    # With echo, each keeps its own count: echo's top_logprobs 1, prompt_logprobs 3.
    body = completion("Once upon a time", 2, echo=True, logprobs=1, prompt_logprobs=3)
    choice = (await (await stack.client()).request(COMPLETIONS, body)).json()["choices"][0]
    prompt = tokenizer.encode("Once upon a time")
    check_prompt_logprobs(tokenizer, choice["prompt_logprobs"], prompt, 3)
    assert any(len(e) > 2 for e in choice["prompt_logprobs"][1:])
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])


REFUSED = [
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),  # OpenAI: top_logprobs needs logprobs: true
    (CHAT, chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (COMPLETIONS, completion(logprobs=21), "logprobs"),
    (COMPLETIONS, completion(logprobs=-1), "logprobs"),
    (COMPLETIONS, completion(prompt_logprobs=21), "prompt_logprobs"),
    (COMPLETIONS, completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),  # as vLLM
    (CHAT, chat(prompt_logprobs=0, stream=True), "prompt_logprobs"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), REFUSED, ids=[f"{r[2]}-{i}" for i, r in enumerate(REFUSED)]
)
async def test_logprobs_refusals(
    stack: Stack, autojump_clock: MockClock, path: str, body: dict[str, Any], param: str
) -> None:
    reply = await (await stack.client()).request(path, body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"]


async def test_max_logprobs_flag(tokenizer: Tokenizer, autojump_clock: MockClock) -> None:
    async with trio.open_nursery() as nursery:
        stack = await start_stack(nursery, tokenizer, override(BASE_CONFIG, max_logprobs=2))
        ok = await (await stack.client()).request(CHAT, chat(logprobs=True, top_logprobs=2))
        assert ok.status == 200
        content = ok.json()["choices"][0]["logprobs"]["content"]
        assert all(len(e["top_logprobs"]) == 2 and math.isfinite(e["logprob"]) for e in content)
        refused = await (await stack.client()).request(COMPLETIONS, completion(logprobs=3))
        assert refused.status == 400 and refused.json()["error"]["param"] == "logprobs"
        nursery.cancel_scope.cancel()
