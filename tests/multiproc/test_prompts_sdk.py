"""Prompts and templates through the unmodified ``openai`` SDK against the whole process tree (API
server → engine core → worker on ``test_model_engine.py``'s tiny random Llama with the Qwen3
tokenizer): several prompts in one completion, truncate_prompt_tokens, a request's chat_template (the
server trusts them here) and continue_final_message, each visible in the prompt tokens the server
reports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from trioserve.frontend.text.tokenizer import load_tokenizer

from ._support import sdk_client
from .conftest import ServerProcess
from .test_model_engine import running_model_server, tiny_model

__all__ = ["tiny_model"]

TIMEOUT = 60
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("logs")
    with running_model_server(
        tiny_model, logs, "prompts_server", "--trust-request-chat-template", timeout=TIMEOUT
    ) as server:
        yield server


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk_client(server.url, timeout=60.0) as sdk:
        yield sdk


def _extra(obj: Any) -> dict[str, Any]:
    return dict(obj.model_extra or {})


EXTRA = {"ignore_eos": True, "return_token_ids": True}


async def test_several_prompts_number_their_choices_as_openai(client: openai.AsyncOpenAI) -> None:
    tokenizer = load_tokenizer(None)
    prompts = ["one two", "three four five"]
    with trio.fail_after(TIMEOUT):
        response = await client.completions.create(
            model="", prompt=prompts, n=2, max_tokens=3, temperature=0.0, extra_body=EXTRA
        )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        own = _extra(choice)["prompt_token_ids"]
        assert own == tokenizer.encode(prompts[choice.index // 2])
    # Greedy: the two samples of one prompt agree; the prompts' answers are their own.
    texts = [c.text for c in response.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]
    assert response.usage is not None
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert response.usage.completion_tokens == 4 * 3


async def test_truncate_prompt_tokens_keeps_the_last_k(client: openai.AsyncOpenAI) -> None:
    tokenizer = load_tokenizer(None)
    prompt = "a b c d e f g h"
    with trio.fail_after(TIMEOUT):
        response = await client.completions.create(
            model="",
            prompt=prompt,
            max_tokens=2,
            temperature=0.0,
            extra_body={**EXTRA, "truncate_prompt_tokens": 3},
        )
    assert response.usage is not None and response.usage.prompt_tokens == 3
    assert _extra(response.choices[0])["prompt_token_ids"] == tokenizer.encode(prompt)[-3:]


async def test_a_request_chat_template_replaces_the_models(client: openai.AsyncOpenAI) -> None:
    tokenizer = load_tokenizer(None)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    with trio.fail_after(TIMEOUT):
        response = await client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=2,
            temperature=0.0,
            extra_body={**EXTRA, "chat_template": template},
        )
    assert _extra(response)["prompt_token_ids"] == tokenizer.encode("[hello]")


async def test_continue_final_message_leaves_the_assistant_turn_open(client: openai.AsyncOpenAI) -> None:
    tokenizer = load_tokenizer(None)
    messages: list[Any] = [
        {"role": "user", "content": "count"},
        {"role": "assistant", "content": "one two"},
    ]
    with trio.fail_after(TIMEOUT):
        closed = await client.chat.completions.create(
            model="", messages=messages, max_tokens=2, temperature=0.0, extra_body=EXTRA
        )
        open_ = await client.chat.completions.create(
            model="",
            messages=messages,
            max_tokens=2,
            temperature=0.0,
            extra_body={**EXTRA, "continue_final_message": True, "add_generation_prompt": False},
        )
    closed_text = tokenizer.decode(_extra(closed)["prompt_token_ids"])
    open_text = tokenizer.decode(_extra(open_)["prompt_token_ids"])
    assert open_text.endswith("one two") and IM_END not in open_text.rsplit("assistant", 1)[-1]
    assert closed_text.rstrip().endswith("assistant")  # a new assistant turn after the closed one
