"""Logprobs end to end, through the unmodified ``openai`` SDK: API server → engine core → worker on the
tiny random Llama (``test_model_engine.py``'s). The values a client gets equal ``log_softmax`` of
transformers' logits for the same tokens: the sampled tokens' (chat and completions, greedy, so the
distribution is the raw one), the alternatives', and the prompt's with ``echo`` (raw logits)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
import torch
import trio
from transformers import AutoModelForCausalLM

from ._support import sdk_client
from .conftest import ServerProcess
from .test_model_engine import running_model_server, tiny_model

__all__ = ["tiny_model"]

TIMEOUT = 60
PROMPT = "the quick brown fox jumps over"
TOL = 1e-3


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_model_server(
        tiny_model, tmp_path_factory.mktemp("logs"), "logprobs_server", timeout=TIMEOUT
    ) as server:
        yield server


@pytest.fixture
async def client(server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk_client(server.url, timeout=60.0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()


def _log_softmax(model: AutoModelForCausalLM, ids: list[int]) -> torch.Tensor:
    """Row p: the log-distribution of the token at position p + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


async def test_completion_logprobs_with_echo_equal_transformers(
    client: openai.AsyncOpenAI, reference: AutoModelForCausalLM
) -> None:
    with trio.fail_after(TIMEOUT):
        response = await client.completions.create(
            model="",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0.0,
            logprobs=3,
            echo=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    choice = response.choices[0]
    extra = dict(choice.model_extra or {})
    prompt_ids: list[int] = extra["prompt_token_ids"]
    output_ids: list[int] = extra["token_ids"]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    values = choice.logprobs.token_logprobs
    ids = prompt_ids + output_ids
    assert len(values) == len(ids)
    assert values[0] is None  # nothing precedes the first prompt token
    table = _log_softmax(reference, ids)
    for p in range(1, len(ids)):
        expected = table[p - 1, ids[p]].item()
        got = values[p]
        assert got is not None and abs(got - expected) < TOL, (p, got, expected)
    # Greedy: each sampled token is the most likely one, and heads its own alternatives.
    tops = choice.logprobs.top_logprobs
    assert tops is not None
    for k, token_id in enumerate(output_ids):
        p = len(prompt_ids) + k
        assert int(table[p - 1].argmax()) == token_id
        alternatives = tops[p]
        assert alternatives is not None and len(alternatives) == 3
        best = sorted(table[p - 1].topk(3).values.tolist(), reverse=True)
        assert sorted(alternatives.values(), reverse=True) == pytest.approx(best, abs=TOL)


async def test_chat_logprobs_streamed_equal_the_unstreamed_and_transformers(
    client: openai.AsyncOpenAI, reference: AutoModelForCausalLM
) -> None:
    kw = {
        "model": "",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 5,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    with trio.fail_after(TIMEOUT):
        whole = await client.chat.completions.create(**kw)  # type: ignore[call-overload]
        stream = await client.chat.completions.create(stream=True, **kw)  # type: ignore[call-overload]
        streamed = [
            entry
            async for chunk in stream
            for c in chunk.choices
            for entry in (c.logprobs.content or [] if c.logprobs else [])
        ]
    content = whole.choices[0].logprobs.content
    assert content is not None and len(content) == 5
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]
    extra = dict(whole.model_extra or {})
    ids = extra["prompt_token_ids"] + dict(whole.choices[0].model_extra or {})["token_ids"]
    table = _log_softmax(reference, ids)
    start = len(extra["prompt_token_ids"])
    for k, entry in enumerate(content):
        assert abs(entry.logprob - table[start + k - 1, ids[start + k]].item()) < TOL
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(
            entry.logprob, abs=TOL
        )
        assert entry.bytes is not None and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
