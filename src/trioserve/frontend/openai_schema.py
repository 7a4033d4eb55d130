"""Request bodies of the OpenAI-compatible routes, decoded and type-checked by msgspec.

Unknown fields are ignored (clients send many we do not use); wrong types are a 400 with msgspec's
message, which names the offending path (``$.messages[0].role``).
"""

from __future__ import annotations

from typing import Any

import msgspec


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
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    logprobs: bool | int | None = None
    # vLLM extensions
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    priority: int = 0


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # str, list[str], list[int] or list[list[int]]; msgspec unions allow one array type, so the
    # list's shape is checked when the prompt is rendered.
    prompt: str | list[str | int | list[int]]
    echo: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None
