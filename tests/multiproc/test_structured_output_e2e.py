"""Structured output on the embedded model (SmolLM2-135M-Instruct), end to end through the ``openai``
SDK: ``chat.completions.parse`` with a pydantic model, JSON-schema answers with ``n > 1`` streamed and
not (each validated by pydantic), vLLM's ``structured_outputs`` choice and regex beside sampling
parameters, and a finish by ``length`` reported as such."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import openai
import pydantic
import pytest
import trio

from .test_embedded_model_api import client, server
from .test_embedded_model_convert import NEEDS_EMBEDDED_MODEL, converted

__all__ = ["client", "converted", "server"]  # fixtures: the embedded model's server, one per module

pytestmark = [pytest.mark.multiproc, NEEDS_EMBEDDED_MODEL]

TIMEOUT = 120


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population_millions: float
    continent: Literal["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]


ASK: list[Any] = [{"role": "user", "content": "Describe Paris as JSON."}]


async def test_the_sdk_parses_a_pydantic_model(client: openai.AsyncOpenAI) -> None:
    with trio.fail_after(TIMEOUT):
        completion = await client.chat.completions.parse(
            model="", messages=ASK, response_format=City, max_tokens=120, temperature=0.0
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City), choice.message.content
    City.model_validate_json(choice.message.content or "", strict=True)


async def test_json_schema_answers_validate_with_n_streamed_and_not(client: openai.AsyncOpenAI) -> None:
    schema = {"name": "city", "schema": City.model_json_schema(), "strict": True}
    common: dict[str, Any] = dict(
        model="",
        messages=ASK,
        max_tokens=120,
        n=3,
        temperature=0.8,
        top_p=0.95,
        seed=7,
        response_format={"type": "json_schema", "json_schema": schema},
    )
    with trio.fail_after(TIMEOUT):
        whole = await client.chat.completions.create(**common)
        texts: dict[int, str] = {}
        finish: dict[int, str | None] = {}
        stream = await client.chat.completions.create(**common, stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                finish[c.index] = c.finish_reason or finish.get(c.index)
    assert len(whole.choices) == 3 and len(texts) == 3
    for choice in whole.choices:
        assert choice.finish_reason == "stop", choice
        City.model_validate_json(choice.message.content or "", strict=True)
    for index, text in texts.items():
        assert finish[index] == "stop"
        City.model_validate_json(text, strict=True)
    # seeded: the stream and the whole response are the same samples
    assert [texts[c.index] for c in whole.choices] == [c.message.content for c in whole.choices]


async def test_choice_and_regex_beside_sampling_parameters(client: openai.AsyncOpenAI) -> None:
    colors = ["red", "green", "dark blue"]
    with trio.fail_after(TIMEOUT):
        picked = await client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=10,
            n=4,
            temperature=1.2,
            frequency_penalty=0.5,
            extra_body={"structured_outputs": {"choice": colors}, "top_k": 20},
        )
        dated = await client.completions.create(
            model="",
            prompt="Today's date is",
            max_tokens=20,
            temperature=0.7,
            extra_body={"guided_regex": r" [0-9]{4}-[01][0-9]-[0-3][0-9]", "repetition_penalty": 1.1},
        )
    for choice in picked.choices:
        assert choice.message.content in colors and choice.finish_reason == "stop"
    assert re.fullmatch(r" [0-9]{4}-[01][0-9]-[0-3][0-9]", dated.choices[0].text), dated.choices[0].text
    assert dated.choices[0].finish_reason == "stop"


async def test_a_length_finish_is_reported_and_a_bad_schema_is_a_400(client: openai.AsyncOpenAI) -> None:
    with trio.fail_after(TIMEOUT):
        short = await client.chat.completions.create(
            model="", messages=ASK, max_tokens=4, response_format={"type": "json_object"}
        )
        assert short.choices[0].finish_reason == "length"
        assert (short.choices[0].message.content or "").startswith("{")
        with pytest.raises(openai.LengthFinishReasonError):
            await client.chat.completions.parse(model="", messages=ASK, response_format=City, max_tokens=4)
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model="",
                messages=ASK,
                max_tokens=4,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                },
            )
    assert "objekt" in json.dumps(info.value.body)


async def test_tool_choice_required_on_the_embedded_model(client: openai.AsyncOpenAI) -> None:
    """SmolLM2's template shows no tools (it has no ``tools`` block, as vLLM would render it too); the
    grammar still makes the answer a valid call."""
    params = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    }
    tools: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    question: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    with trio.fail_after(TIMEOUT):
        response = await client.chat.completions.create(
            model="", messages=question, tools=tools, tool_choice="required", max_tokens=80, temperature=0
        )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)  # type: ignore[union-attr]
