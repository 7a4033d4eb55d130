"""Every logits processor end to end, through the unmodified ``openai`` SDK: API server → engine core →
worker on a tiny random Llama with the Qwen3 tokenizer (``test_model_engine.py``'s), where each effect
must be visible in the tokens: logit_bias -100 on the greedy token moves off it and +100 forces one;
min_p 0.9 and 0 differ at temperature 1 with one seed; the penalties change greedy output where it
repeats; allowed_token_ids restricts every token; bad_words keep the banned word out; a seed with all
of them on gives the same tokens twice; values out of range are 400s naming the parameter. And the mock
engine takes them all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio

from trioserve.frontend.request.validate import bad_words_token_ids
from trioserve.frontend.text.tokenizer import load_tokenizer

from ._support import sdk_client
from .conftest import MODEL, ServerProcess
from .test_model_engine import running_model_server, tiny_model

__all__ = ["tiny_model"]  # the module fixture, shared with test_model_engine.py

TIMEOUT = 60
PROMPT = "one two three one two three one two three"


@pytest.fixture(scope="module")
def sampling_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_model_server(
        tiny_model, tmp_path_factory.mktemp("logs"), "sampling_server", timeout=TIMEOUT
    ) as server:
        yield server


@pytest.fixture
async def client(sampling_server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk_client(sampling_server.url, timeout=60.0) as sdk:
        yield sdk


async def tokens(client: openai.AsyncOpenAI, max_tokens: int = 12, **kw: Any) -> list[int]:
    """The completion's token ids (greedy unless told otherwise); vLLM's parameters go in extra_body."""
    kw.setdefault("temperature", 0.0)
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    with trio.fail_after(TIMEOUT):
        response = await client.completions.create(
            model=kw.pop("model", ""),
            prompt=kw.pop("prompt", PROMPT),
            max_tokens=max_tokens,
            extra_body=extra,
            **kw,
        )
    ids: list[int] = dict(response.choices[0].model_extra or {})["token_ids"]
    assert len(ids) == max_tokens
    return ids


@pytest.fixture
async def greedy(client: openai.AsyncOpenAI) -> list[int]:
    return await tokens(client, 16)


async def test_logit_bias_moves_off_the_greedy_token_and_forces_another(
    client: openai.AsyncOpenAI, greedy: list[int]
) -> None:
    away = await tokens(client, 16, logit_bias={str(greedy[0]): -100})
    assert away[0] != greedy[0]
    forced = 1234
    assert await tokens(client, 8, logit_bias={str(forced): 100}, temperature=1.0) == [forced] * 8
    chat = await client.chat.completions.create(
        model="",  # the served model
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert dict(chat.choices[0].model_extra or {})["token_ids"] == [forced] * 5


async def test_min_p_cuts_the_tail_at_temperature_one(client: openai.AsyncOpenAI, greedy: list[int]) -> None:
    loose = await tokens(client, 16, temperature=1.0, seed=7, extra_body={"min_p": 0.0})
    tight = await tokens(client, 16, temperature=1.0, seed=7, extra_body={"min_p": 0.9})
    assert loose != tight
    # min_p 1 keeps only the most likely token: sampling becomes greedy.
    assert await tokens(client, 16, temperature=1.0, seed=7, extra_body={"min_p": 1.0}) == greedy


async def test_penalties_change_greedy_output_where_it_repeats(
    client: openai.AsyncOpenAI, greedy: list[int]
) -> None:
    assert len(set(greedy)) < len(greedy)  # the random model loops: the penalties have work to do
    repeat_penalized = await tokens(client, 16, extra_body={"repetition_penalty": 2.0})
    assert repeat_penalized != greedy
    assert await tokens(client, 16, frequency_penalty=2.0) != greedy
    assert await tokens(client, 16, presence_penalty=2.0) != greedy
    # A negative presence penalty rewards repeats: never fewer repeated tokens than plain greedy.
    rewarded = await tokens(client, 16, presence_penalty=-2.0)
    assert len(set(rewarded)) <= len(set(greedy))


async def test_allowed_token_ids_restrict_every_token(client: openai.AsyncOpenAI) -> None:
    allowed = [11, 222, 3333, 44444]
    for temperature in (0.0, 1.5):
        got = await tokens(client, 24, temperature=temperature, extra_body={"allowed_token_ids": allowed})
        assert set(got) <= set(allowed)
    assert len(set(got)) > 1  # sampled, not stuck on one


async def test_bad_words_keep_the_word_out(
    client: openai.AsyncOpenAI, greedy: list[int], tiny_model: Path
) -> None:
    tokenizer = load_tokenizer(str(tiny_model))
    word = tokenizer.decode([greedy[0]])
    sequences = bad_words_token_ids([word], tokenizer, tokenizer.vocab_size)
    banned = {s[0] for s in sequences if len(s) == 1}
    assert greedy[0] in banned  # the greedy first token is (one tokenization of) the word
    got = await tokens(client, 16, extra_body={"bad_words": [word]})
    assert not banned & set(got)


async def test_a_seed_with_every_parameter_repeats_itself(client: openai.AsyncOpenAI) -> None:
    body: dict[str, Any] = dict(
        temperature=1.0,
        top_p=0.95,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"100": 5, "200": -100},
        extra_body={
            "top_k": 500,
            "min_p": 0.01,
            "repetition_penalty": 1.3,
            "allowed_token_ids": list(range(100, 2100)),
            "bad_words": ["hello"],
        },
    )
    first = await tokens(client, 16, **body)
    assert await tokens(client, 16, **body) == first
    assert all(100 <= t < 2100 and t != 200 for t in first)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": -0.5}}, "min_p"),
        ({"logit_bias": {"151669": 1}}, "logit_bias"),  # the tiny model's vocabulary ends at 151669
        ({"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
        ({"extra_body": {"bad_words": [""]}}, "bad_words"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
async def test_out_of_range_is_a_400_naming_the_parameter(
    client: openai.AsyncOpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await tokens(client, 4, **extra)
    assert info.value.status_code == 400
    body: Any = info.value.body
    assert body["param"] == param


async def test_the_mock_engine_accepts_every_parameter(server: ServerProcess) -> None:
    """It samples at random, so it shows no effect; it has to take them, so frontend benchmarks run."""
    sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30.0)
    try:
        with trio.fail_after(TIMEOUT):
            response = await sdk.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=6,
                presence_penalty=1.0,
                frequency_penalty=-1.0,
                logit_bias={"5": 50},
                seed=3,
                extra_body={
                    "ignore_eos": True,
                    "repetition_penalty": 1.2,
                    "min_p": 0.1,
                    "allowed_token_ids": [1, 2, 3],
                    "bad_words": ["hello", "New York"],
                },
            )
    finally:
        await sdk.close()
    assert response.usage is not None and response.usage.completion_tokens == 6
