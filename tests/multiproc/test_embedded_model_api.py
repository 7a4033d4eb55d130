"""The OpenAI API surface on the embedded model (SmolLM2-135M-Instruct), end to end through the
``openai`` SDK: a real answer, then logit_bias taking it away, logprobs of it, and
continue_final_message continuing an assistant turn instead of starting a new one."""

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
from .test_embedded_model_convert import NEEDS_EMBEDDED_MODEL, converted
from .test_model_engine import running_model_server

__all__ = ["converted"]

pytestmark = [pytest.mark.multiproc, NEEDS_EMBEDDED_MODEL]

TIMEOUT = 120
QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(
    converted: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    folder, _ = converted
    with running_model_server(
        folder, tmp_path_factory.mktemp("logs"), "embedded_api", "--max-model-len", "512", timeout=TIMEOUT
    ) as server:
        yield server


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk_client(server.url, timeout=TIMEOUT) as sdk:
        yield sdk


async def test_logit_bias_and_logprobs_on_the_real_answer(
    client: openai.AsyncOpenAI, converted: tuple[Path, list[str]]
) -> None:
    with trio.fail_after(TIMEOUT):
        plain = await client.chat.completions.create(
            model="",
            messages=QUESTION,
            max_tokens=20,
            temperature=0.0,
            logprobs=True,
            top_logprobs=3,
        )
    answer = plain.choices[0].message.content or ""
    assert "Paris" in answer, answer
    content = plain.choices[0].logprobs.content if plain.choices[0].logprobs else None
    assert content is not None and "".join(e.token for e in content).startswith(answer[:10])
    for entry in content:  # greedy: each token is its own most likely alternative
        assert entry.logprob <= 0 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-3)
    # Every way the model spells Paris, banned: the answer must do without it.
    tokenizer = load_tokenizer(str(converted[0]))
    ids = {t for word in ("Paris", " Paris") for t in tokenizer.encode(word)[:1]}
    with trio.fail_after(TIMEOUT):
        biased = await client.chat.completions.create(
            model="",
            messages=QUESTION,
            max_tokens=20,
            temperature=0.0,
            logit_bias={str(t): -100 for t in ids},
        )
    assert "Paris" not in (biased.choices[0].message.content or "")


async def test_continue_final_message_continues_the_assistant_turn(client: openai.AsyncOpenAI) -> None:
    prefix = "The capital of France is"
    with trio.fail_after(TIMEOUT):
        response = await client.chat.completions.create(
            model="",
            messages=[*QUESTION, {"role": "assistant", "content": prefix}],
            max_tokens=8,
            temperature=0.0,
            extra_body={"continue_final_message": True, "add_generation_prompt": False},
        )
    text = response.choices[0].message.content or ""
    assert "Paris" in text and not text.startswith(prefix), text
