"""Turns a decoded OpenAI request into the engine's sampling parameters, or an ``ApiError``.

Checks that need the prompt length (context window) run after rendering, in ``check_length``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgspec

from trioserve.config import ServeConfig
from trioserve.frontend.errors import ApiError
from trioserve.frontend.openai_schema import ChatCompletionRequest, CompletionRequest, _Sampling
from trioserve.protocol.messages import SamplingParams

T = TypeVar("T")

_MAX_STOP_STRINGS = 16
# Every step the engine sends carries each new request's sampling parameters, and the worker ring's
# slot is sized for at most this many stop ids per request (engine/worker_executor.step_slot_bytes).
MAX_STOP_TOKEN_IDS = 128
_INT64 = 2**63


def decode_body(body: bytes, kind: type[T]) -> T:
    if not body.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How the API server shapes what it streams back; the engine never sees these."""

    model: str
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool


def resolve_model(requested: str | None, names: tuple[str, ...]) -> str:
    if requested is None or requested == "":
        return names[0]
    if requested not in names:
        raise ApiError(404, f"The model `{requested}` does not exist.", param="model")
    return requested


def output_options(req: _Sampling, config: ServeConfig) -> OutputOptions:
    model = resolve_model(req.model, config.model_names)
    if not 1 <= req.n <= config.max_n:
        raise ApiError(400, f"n must be between 1 and {config.max_n}, got {req.n}", param="n")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported by this server", param="logprobs")
    stop: tuple[str, ...]
    if req.stop is None:
        stop = ()
    elif isinstance(req.stop, str):
        stop = (req.stop,) if req.stop else ()
    else:
        stop = tuple(s for s in req.stop if s)
    if len(stop) > _MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {_MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return OutputOptions(
        model=model,
        n=req.n,
        stream=req.stream,
        include_usage=include_usage,
        return_token_ids=req.return_token_ids,
        stop=stop,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )


def requested_max_tokens(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest):
        value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    else:
        value = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's completions default
        param = "max_tokens"
    if value is not None and value < 1:
        raise ApiError(400, f"{param} must be at least 1, got {value}", param=param)
    return value


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest, config: ServeConfig, prompt_len: int
) -> SamplingParams:
    """Engine sampling parameters; ``prompt_len`` bounds max_tokens by the context window."""
    check_length(prompt_len, config.max_model_len)
    room = config.max_model_len - prompt_len
    max_tokens = requested_max_tokens(req)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
            "for the completion). Please reduce the length of the prompt or completion.",
            param="max_tokens",
        )
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2], got {temperature}", param="temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
    if top_k < 0:
        raise ApiError(400, f"top_k must be -1 (off) or >= 0, got {req.top_k}", param="top_k")
    if req.seed is not None and not -_INT64 <= req.seed < _INT64:
        raise ApiError(400, "seed must fit in a signed 64-bit integer", param="seed")
    if req.min_tokens < 0 or req.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens must be in [0, max_tokens={max_tokens}]", param="min_tokens")
    stop_ids = req.stop_token_ids or []
    if any(t < 0 for t in stop_ids):
        raise ApiError(400, "stop_token_ids must be non-negative", param="stop_token_ids")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(
            400, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", param="stop_token_ids"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=req.seed,
        stop_token_ids=list(stop_ids),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
    )


def check_length(prompt_len: int, max_model_len: int) -> None:
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {prompt_len} tokens, leaving no room for a completion.",
            param="messages",
        )
