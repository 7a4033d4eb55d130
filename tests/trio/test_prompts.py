"""Prompts and templates end to end, on the in-process stack (MockClock): several prompts in one
completions request, ``--chat-template`` and a request's ``chat_template``, ``continue_final_message``
and ``truncate_prompt_tokens``. The rendered prompt is read back from ``return_token_ids``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from tests.trio.conftest import BASE_CONFIG, Stack, start_stack
from trioserve.config import ServeConfig, override
from trioserve.frontend.request.validate import MAX_CHOICES
from trioserve.frontend.text.tokenizer import Tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPTS = ["Hello there", "Count with me: one two three four", "x"]
WINDOW = BASE_CONFIG.model.max_model_len  # 512


def completion(prompt: Any, max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True, **extra}


def chat(messages: list[dict[str, Any]], max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


USER = [{"role": "user", "content": "hi"}]


def idle(stack: Stack) -> bool:
    return not stack.api.serving.active and not stack.api.handler.choices and not stack.engine.core.running


@asynccontextmanager
async def _stack(tokenizer: Tokenizer, config: ServeConfig) -> AsyncIterator[Stack]:
    async with trio.open_nursery() as nursery:
        yield await start_stack(nursery, tokenizer, config)
        nursery.cancel_scope.cancel()


# ---- several prompts ---------------------------------------------------------------------------------


async def test_several_prompts_one_choice_per_prompt_per_n(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    reply = await (await stack.client()).request(COMPLETIONS, completion(PROMPTS, n=2, seed=5))
    assert reply.status == 200, reply.body
    data = reply.json()
    choices = data["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    # Choice i is sample i % n of prompt i // n (OpenAI's numbering); each carries its own prompt.
    assert [c["prompt_token_ids"] for c in choices] == [encoded[i // 2] for i in range(6)]
    assert all(len(c["token_ids"]) == 3 and c["finish_reason"] == "length" for c in choices)
    assert "prompt_token_ids" not in data  # one prompt per choice, none for the response
    prompt_tokens = sum(len(e) for e in encoded)  # each prompt once, whatever n is
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 18,
        "total_tokens": prompt_tokens + 18,
    }
    # Each prompt's samples are what the prompt alone gets with the same seed.
    alone = await (await stack.client()).request(COMPLETIONS, completion(PROMPTS[1], n=2, seed=5))
    assert [c["token_ids"] for c in alone.json()["choices"]] == [c["token_ids"] for c in choices[2:4]]
    assert idle(stack)


async def test_several_prompts_streamed(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    body = completion(PROMPTS, max_tokens=4, n=2, stream=True, stream_options={"include_usage": True})
    reply = await (await stack.client()).request(COMPLETIONS, body)
    assert reply.status == 200
    tokens: dict[int, list[int]] = defaultdict(list)
    finished = {}
    for chunk in reply.content_events():
        for choice in chunk["choices"]:
            tokens[choice["index"]] += choice["token_ids"]
            if choice["finish_reason"] is not None:
                finished[choice["index"]] = choice["finish_reason"]
    assert sorted(tokens) == list(range(6)) and all(len(t) == 4 for t in tokens.values())
    assert finished == dict.fromkeys(range(6), "length")
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert reply.chunks[-1]["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 24,
        "total_tokens": prompt_tokens + 24,
    }
    assert reply.events[-1].data == "[DONE]"
    assert idle(stack)


async def test_continuous_usage_sums_the_prompts(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    reply = await (await stack.client()).request(
        COMPLETIONS, completion(PROMPTS, stream=True, stream_options=options)
    )
    prompt_tokens = sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert {c["usage"]["prompt_tokens"] for c in reply.chunks} == {prompt_tokens}
    assert reply.chunks[-1]["usage"]["completion_tokens"] == 9


async def test_several_token_id_prompts(stack: Stack, autojump_clock: MockClock) -> None:
    reply = await (await stack.client()).request(COMPLETIONS, completion([[1, 2, 3], [4, 5]]))
    data = reply.json()
    assert [(c["index"], c["prompt_token_ids"]) for c in data["choices"]] == [(0, [1, 2, 3]), (1, [4, 5])]
    assert data["usage"]["prompt_tokens"] == 5
    # One list of ids, and a list holding one prompt, are one prompt (with the response's ids too).
    for prompt in ([7, 8, 9], [[7, 8, 9]], ["seven"]):
        one = (await (await stack.client()).request(COMPLETIONS, completion(prompt))).json()
        assert len(one["choices"]) == 1 and one["prompt_token_ids"] == one["choices"][0]["prompt_token_ids"]


@pytest.mark.parametrize(
    ("prompt", "extra", "param", "words"),
    [
        (["ok", "word " * WINDOW], {}, "prompt[1]", "maximum context length"),
        (["ok", "word " * 500], {"max_tokens": 100}, "prompt[1]", "maximum context length"),
        (["ok", ""], {}, "prompt[1]", "empty"),
        ([[1, 2], [3, 10**9]], {}, "prompt[1]", "token ids must be in"),
        (["ok", [1, 2]], {}, "prompt", "all strings or all token-id lists"),
        ([1, "a"], {}, "prompt", "must be a string"),
        (["a"] * (MAX_CHOICES // 2 + 1), {"n": 2}, "prompt", f"at most {MAX_CHOICES} choices"),
    ],
    ids=["too-long", "no-room", "empty", "vocab", "mixed", "ids-then-string", "too-many"],
)
async def test_a_bad_prompt_among_several_is_a_400_that_names_it(
    stack: Stack, autojump_clock: MockClock, prompt: Any, extra: dict[str, Any], param: str, words: str
) -> None:
    reply = await (await stack.client()).request(COMPLETIONS, completion(prompt, **extra))
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert idle(stack)


async def test_admission_counts_a_request_with_several_prompts_as_one(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    async with _stack(tokenizer, override(BASE_CONFIG, max_concurrent_requests=1)) as stack:
        first = await stack.client()
        await first.send_request(COMPLETIONS, completion(PROMPTS, max_tokens=50, stream=True))
        head = await first.read_head()
        assert head.status == 200  # three prompts, one slot
        streamed = await first.read_body(head, max_events=2)
        refused = await (await stack.client()).request(COMPLETIONS, completion("one more"))
        assert refused.status == 429
        await first.read_body(streamed)
        assert (await (await stack.client()).request(COMPLETIONS, completion("now"))).status == 200


# ---- chat templates ----------------------------------------------------------------------------------

MARKED = (
    "MARKER{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def rendered(tokenizer: Tokenizer, reply_json: dict[str, Any]) -> str:
    return tokenizer.decode(reply_json["prompt_token_ids"], skip_special_tokens=False)


async def test_the_server_chat_template_renders_every_chat_prompt(
    tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    async with _stack(tokenizer, override(BASE_CONFIG, chat_template=MARKED)) as stack:
        client = await stack.client()
        reply = await client.request(CHAT, chat(USER))
        assert reply.status == 200
        assert rendered(tokenizer, reply.json()) == "MARKER[user:hi]<|im_start|>assistant\n"
        # /tokenize renders messages the same way.
        tokenized = (await client.request("/tokenize", {"messages": USER})).json()
        assert tokenized["tokens"] == reply.json()["prompt_token_ids"]


async def test_a_request_chat_template_needs_the_operators_trust(
    stack: Stack, autojump_clock: MockClock
) -> None:
    reply = await (await stack.client()).request(CHAT, chat(USER, chat_template=MARKED))
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


@pytest.fixture
async def trusting(tokenizer: Tokenizer, autojump_clock: MockClock) -> AsyncIterator[Stack]:
    config = override(
        BASE_CONFIG, trust_request_chat_template=True, chat_template="SERVER{{ messages[0].content }}"
    )
    async with _stack(tokenizer, config) as stack:
        yield stack


async def test_a_request_chat_template_replaces_the_servers(
    trusting: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    client = await trusting.client()
    for _ in range(3):
        reply = await client.request(CHAT, chat(USER, chat_template=MARKED))
        assert reply.status == 200
        assert rendered(tokenizer, reply.json()) == "MARKER[user:hi]<|im_start|>assistant\n"
    assert trusting.api.serving.request_templates.compiles == 1  # compiled once, by its text
    plain = await client.request(CHAT, chat(USER))
    assert rendered(tokenizer, plain.json()) == "SERVERhi"  # without one: the server's


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{% for m in messages %}", "does not compile: line 1"),
        ("{{ raise_exception('no system prompt') }}", "no system prompt"),
        ("{{ messages[0].content + 1 }}", "rejected the messages"),
        ("{{ ''.__class__.__mro__ }}", "SecurityError"),  # sandboxed, as the model's own template is
        ("{{ cycler.__init__.__globals__ }}", "SecurityError"),
    ],
    ids=["syntax", "raises", "type-error", "dunder", "globals"],
)
async def test_a_request_chat_template_that_fails_is_a_400_naming_it(
    trusting: Stack, autojump_clock: MockClock, template: str, words: str
) -> None:
    reply = await (await trusting.client()).request(CHAT, chat(USER, chat_template=template))
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == "chat_template" and words in error["message"], error
    assert idle(trusting)


# ---- continue_final_message ---------------------------------------------------------------------------


async def test_continue_final_message_ends_the_prompt_inside_the_assistant_text(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    messages = [
        {"role": "user", "content": "Finish this."},
        {"role": "assistant", "content": "The answer is"},
    ]
    body = chat(messages, continue_final_message=True, add_generation_prompt=False)
    reply = await (await stack.client()).request(CHAT, body)
    assert reply.status == 200, reply.body
    data = reply.json()
    text = rendered(tokenizer, data)
    assert text == "<|im_start|>user\nFinish this.<|im_end|>\n<|im_start|>assistant\nThe answer is"
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    im_end = tokenizer.encode("<|im_end|>")[0]
    assert data["prompt_token_ids"][-1] != im_end and closed[-2] == im_end  # continued, not closed
    assert len(data["choices"][0]["token_ids"]) == 3


async def test_continue_final_message_with_add_generation_prompt_is_a_400(
    stack: Stack, autojump_clock: MockClock
) -> None:
    reply = await (await stack.client()).request(CHAT, chat(USER, continue_final_message=True))
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == "continue_final_message"
    assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True." in error["message"]


# ---- truncate_prompt_tokens ----------------------------------------------------------------------------

LONG = " ".join(f"w{i}" for i in range(400))  # longer than the 512-token window


async def test_truncate_prompt_tokens_keeps_the_last_tokens(
    stack: Stack, tokenizer: Tokenizer, autojump_clock: MockClock
) -> None:
    client = await stack.client()
    full = tokenizer.encode(LONG)
    assert len(full) > WINDOW
    assert (await client.request(COMPLETIONS, completion(LONG))).status == 400  # too long as it is
    reply = (await client.request(COMPLETIONS, completion(LONG, truncate_prompt_tokens=10))).json()
    assert reply["usage"]["prompt_tokens"] == 10 and reply["prompt_token_ids"] == full[-10:]
    # Several prompts: each on its own (a shorter one is left whole).
    several = (await client.request(COMPLETIONS, completion([LONG, "hi"], truncate_prompt_tokens=8))).json()
    assert [len(c["prompt_token_ids"]) for c in several["choices"]] == [8, len(tokenizer.encode("hi"))]
    # Chat: the rendered prompt's last tokens.
    whole = (await client.request(CHAT, chat(USER))).json()["prompt_token_ids"]
    cut = (await client.request(CHAT, chat(USER, truncate_prompt_tokens=4))).json()
    assert cut["prompt_token_ids"] == whole[-4:] and cut["usage"]["prompt_tokens"] == 4
    # -1: the context window, which leaves a prompt shorter than it whole.
    window = (await client.request(CHAT, chat(USER, truncate_prompt_tokens=-1))).json()
    assert window["prompt_token_ids"] == whole


@pytest.mark.parametrize(
    ("keep", "param", "words"),
    [
        (WINDOW + 1, "truncate_prompt_tokens", "greater than max_model_len (512)"),
        (0, "prompt", "empty"),
        (-1, "prompt", "maximum context length"),  # the whole window leaves no room to generate
    ],
)
async def test_truncation_refusals(
    stack: Stack, autojump_clock: MockClock, keep: int, param: str, words: str
) -> None:
    reply = await (await stack.client()).request(COMPLETIONS, completion(LONG, truncate_prompt_tokens=keep))
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
