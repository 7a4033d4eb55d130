"""Tool calling end to end through the ``openai`` SDK, on a tiny random Qwen3 with Qwen3's template
(served with ``--enable-auto-tool-choice --tool-call-parser hermes``): with ``tool_choice:
"required"`` or a named function the output is a valid call whose arguments validate against the
function's schema whatever the weights prefer, streamed and not; tool-role messages and assistant
``tool_calls`` in the history render; ``auto`` streams whatever the model writes through the hermes
parser, the same as the whole response. (The embedded model's: ``test_structured_output_e2e.py``.)"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import openai
import pydantic
import pytest
import torch
import trio
from transformers import Qwen3Config, Qwen3ForCausalLM

from trioserve.frontend.text.tokenizer import load_tokenizer

from ._support import sdk_client
from .conftest import ServerProcess
from .test_model_engine import running_model_server, tiny_config

pytestmark = pytest.mark.multiproc
TIMEOUT = 120


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


class Clock(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    zone: Literal["UTC", "CET"]


TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": Weather.model_json_schema(),
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": Clock.model_json_schema()}},
]
SCHEMAS: dict[str, type[pydantic.BaseModel]] = {"get_weather": Weather, "get_time": Clock}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        SCHEMAS[name].model_validate_json(arguments, strict=True)


@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = load_tokenizer(None)  # the built-in Qwen3 tokenizer, with Qwen3's template and tools
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**tiny_config(tokenizer))).save_pretrained(folder)
    tokenizer.hf_tokenizer.save_pretrained(folder)
    flags = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "1024")
    with running_model_server(folder, tmp_path_factory.mktemp("logs"), "tools_qwen3", *flags) as server:
        yield server


@pytest.fixture
async def client(qwen3_server: ServerProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk_client(qwen3_server.url, timeout=TIMEOUT) as sdk:
        yield sdk


async def streamed_calls(
    client: openai.AsyncOpenAI, **request: Any
) -> tuple[list[tuple[str, str]], str | None, str]:
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    content = ""
    finish = None
    stream = await client.chat.completions.create(model="", stream=True, **request)
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for call in c.delta.tool_calls or []:
                if call.function and call.function.name:
                    assert call.index not in names and call.id and call.id.startswith("chatcmpl-tool-")
                    names[call.index] = call.function.name
                args[call.index] = args.get(call.index, "") + (
                    (call.function and call.function.arguments) or ""
                )
    return [(names[i], args[i]) for i in sorted(names)], finish, content


async def test_required_and_named_calls_validate_on_random_weights(client: openai.AsyncOpenAI) -> None:
    common: dict[str, Any] = dict(messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0, seed=3)
    with trio.fail_after(TIMEOUT):
        whole = await client.chat.completions.create(model="", tool_choice="required", n=2, **common)
        for choice in whole.choices:
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls or []
            check_calls([(c.function.name, c.function.arguments) for c in calls])  # type: ignore[union-attr]
        streamed, finish, content = await streamed_calls(client, tool_choice="required", **common)
        assert finish == "tool_calls" and content == ""
        check_calls(streamed)
        named = {"type": "function", "function": {"name": "get_time"}}
        one = await client.chat.completions.create(
            model="",
            tool_choice=named,
            parallel_tool_calls=False,
            **common,  # type: ignore[arg-type]
        )
        assert one.choices[0].finish_reason == "stop"
        calls = one.choices[0].message.tool_calls or []
        assert [c.function.name for c in calls] == ["get_time"]  # type: ignore[union-attr]
        check_calls([(c.function.name, c.function.arguments) for c in calls])  # type: ignore[union-attr]
        single = await client.chat.completions.create(
            model="", tool_choice="required", parallel_tool_calls=False, **common
        )
        assert len(single.choices[0].message.tool_calls or []) == 1


async def test_a_tool_conversation_renders_and_auto_streams_through_the_parser(
    client: openai.AsyncOpenAI,
) -> None:
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": json.dumps({"temperature": 21})},
    ]
    with trio.fail_after(TIMEOUT):
        calls, finish, content = await streamed_calls(
            client, messages=history, tools=TOOLS, max_tokens=40, temperature=1.0, seed=1
        )
        whole = await client.chat.completions.create(
            model="", messages=history, tools=TOOLS, max_tokens=40, temperature=1.0, seed=1
        )
    # Random weights rarely write a call; whatever they write, the stream and the whole agree.
    assert finish in ("stop", "length", "tool_calls")
    message = whole.choices[0].message
    assert (message.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == calls  # type: ignore[union-attr]
