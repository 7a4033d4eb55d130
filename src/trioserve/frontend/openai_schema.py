"""Request bodies of the OpenAI-compatible routes, decoded and type-checked by msgspec.

Unknown fields are ignored (clients send many we do not use); wrong types are a 400 with msgspec's
message, which names the offending path (``$.messages[0].role``).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# Integer fields are bounded at decode time: an out-of-range value is a 400 naming the field, never an
# overflow deeper in (msgpack carries at most 64-bit integers to the engine).
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completions (OpenAI's, plus vLLM's extensions)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    n: Count = 1
    logprobs: bool | Count | None = None
    # vLLM extensions
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    priority: Count = 0


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # str, list[str], list[int] or list[list[int]]; msgspec unions allow one array type, so the
    # list's shape is checked when the prompt is rendered.
    prompt: str | list[str | TokenId | list[TokenId]]
    echo: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None
