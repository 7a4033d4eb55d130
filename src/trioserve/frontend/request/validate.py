"""Turns a decoded OpenAI request into the engine's sampling parameters, or an ``ApiError``.

Order of the checks for one request: decoding (types, unknown fields, nesting), then value ranges,
then the refusal of parameters that are not supported yet (a value outside OpenAI's range is a range
error whether or not the feature exists), then the checks that need the prompt length (context
window), which run after rendering, in ``check_length``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import msgspec

from trioserve.config import ModelConfig, RequestConfig
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    _Sampling,
)
from trioserve.frontend.text.stop_strings import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from trioserve.protocol.messages import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOKENS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

T = TypeVar("T")

_INT64 = 2**63
# Free-form JSON the server hands on (``chat_template_kwargs`` reaches the template as variables) is
# nested at most this deep; deeper is a 400, never a RecursionError somewhere downstream.
MAX_JSON_DEPTH = 32
# OpenAI's bounds: logit_bias values (its entries: MAX_LOGIT_BIAS_ENTRIES, a cross-process limit);
# top_logprobs (chat), which vLLM's default max_logprobs also uses for every logprobs count.
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20
# Choices one request may ask for (prompts x n): each is an engine request, and admission counts the
# whole request as one.
MAX_CHOICES = 1024


# ---- what every accepted field without an effect is, and why ----------------------------------------

INFORMATIONAL_FIELDS: dict[str, str] = {
    # Accepted at any value: none of them changes what a response contains, at OpenAI or here.
    "user": "an end-user id OpenAI uses for abuse monitoring; no output depends on it",
    "safety_identifier": "OpenAI's successor to `user`, for the same monitoring; no output depends on it",
    "metadata": "tags for completions that OpenAI stores (`store`, refused here unless false); no output "
    "depends on them",
    "prompt_cache_key": "a hint for how OpenAI routes requests to its prompt caches; no output depends on "
    "it (the prefix cache here finds shared prefixes by their tokens)",
}


class Unsupported(NamedTuple):
    """A parameter that is not implemented yet: accepted only at values whose meaning is what the
    server does anyway, refused with a 400 naming it at any other value."""

    accepts: str  # the neutral values, as the error message lists them
    neutral: Callable[[Any, Any], bool]  # (value, the struct holding it) -> neutral?
    why: str  # why exactly those values are neutral
    note: str = ""  # said in the error after the values (what vLLM does with it, say)


def _none(value: Any, _: Any) -> bool:
    return value is None


def _false(value: Any, _: Any) -> bool:
    return value is None or value is False


def _empty(value: Any, _: Any) -> bool:
    return not value  # None, [] or {}


UNSUPPORTED_FIELDS: dict[str, Unsupported] = {
    # Keys are JSON paths; ``messages[]`` is every message. Checked in this order.
    "best_of": Unsupported(
        "null or n",
        lambda v, req: v is None or v == req.n,
        "the best n of n samples are all n: what n does",
        "; vLLM's V1 engine removed best_of as well: ask for n samples and rank them yourself",
    ),
    "suffix": Unsupported(
        'null or ""',
        _empty,
        "an empty suffix adds nothing after the completion",
        "; vLLM refuses it too (fill-in-the-middle: send the model's own FIM tokens in `prompt`)",
    ),
    "store": Unsupported("null or false", _false, "nothing is stored"),
    "service_tier": Unsupported(
        'null, "auto" or "default"',
        lambda v, _: v in (None, "auto", "default"),
        "the server has one tier, the default; flex or priority would promise another latency",
    ),
    "stream_options.include_obfuscation": Unsupported(
        "null or false", _false, "the server's chunks carry no obfuscation padding"
    ),
    "messages[].refusal": Unsupported("null", _none, "an assistant turn that refused nothing"),
    "messages[].annotations": Unsupported("null or []", _empty, "an assistant turn that cites nothing"),
    "messages[].audio": Unsupported("null", _none, "an assistant turn without audio"),
    "messages[].function_call": Unsupported(
        "null", _none, "an assistant turn without a (deprecated-style) function call"
    ),
    "modalities": Unsupported(
        '["text"]', lambda v, _: v is None or v == ["text"], "text is the only output the server produces"
    ),
}

_TOP_LEVEL = [(name, entry) for name, entry in UNSUPPORTED_FIELDS.items() if "." not in name]
_IN_STREAM_OPTIONS = [
    (name, name.removeprefix("stream_options."), entry)
    for name, entry in UNSUPPORTED_FIELDS.items()
    if name.startswith("stream_options.")
]
_IN_MESSAGES = [
    (name.removeprefix("messages[]."), entry)
    for name, entry in UNSUPPORTED_FIELDS.items()
    if name.startswith("messages[].")
]


def _not_supported(param: str, entry: Unsupported) -> ApiError:
    return ApiError(
        400,
        f"`{param}` is not supported by this server yet (it accepts only {entry.accepts}){entry.note}",
        param=param,
    )


def refuse_unsupported(req: _Sampling) -> None:
    """400 for the first not-yet-supported parameter set to a value with an effect."""
    for name, entry in _TOP_LEVEL:
        value = getattr(req, name, None)  # each name exists on chat, completions, or both
        if value is not None and not entry.neutral(value, req):
            raise _not_supported(name, entry)
    if req.stream_options is not None:
        for path, name, entry in _IN_STREAM_OPTIONS:
            value = getattr(req.stream_options, name)
            if value is not None and not entry.neutral(value, req.stream_options):
                raise _not_supported(path, entry)


def refuse_unsupported_in_message(message: ChatMessage, index: int) -> None:
    for name, entry in _IN_MESSAGES:
        value = getattr(message, name)
        if value is not None and not entry.neutral(value, message):
            raise _not_supported(f"messages[{index}].{name}", entry)


# ---- decoding --------------------------------------------------------------------------------------

_PATH = re.compile(r"`\$\.?([^`]*)`$")  # msgspec ends a message with the path: ... - at `$.a[0].b`
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`")
_PART_TYPE = re.compile(r"^messages\[\d+\]\.content\[\d+\]\.type$")


def _validation_error(message: str) -> ApiError:
    match = _PATH.search(message)
    param = match.group(1).replace("[...]", "") if match else ""  # "[...]": some key of a dict
    unknown = _UNKNOWN.match(message)
    if unknown:
        param = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        return ApiError(
            400,
            f"unknown parameter `{param}` (this server refuses parameters it does not implement rather "
            "than ignore them)",
            param=param,
        )
    if _PART_TYPE.match(param) and message.startswith("Invalid enum value"):
        return ApiError(400, f"{param}: only text content parts are supported ({message})", param=param)
    return ApiError(400, f"invalid request: {message}", param=param or None)


def decode_body(body: bytes, kind: type[T]) -> T:
    if not body.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    except RecursionError:
        # msgspec decodes recursively and stops at the interpreter's recursion limit.
        raise ApiError(400, "the request body is nested too deeply") from None


def json_depth(value: object, limit: int) -> int:
    """How deeply ``value`` nests lists and dicts, counted without recursion up to ``limit + 1``."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


# ---- per-request options -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How the API server shapes what it streams back; the engine never sees these."""

    model: str
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every streamed chunk, not only the final one
    return_token_ids: bool
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    # Alternatives per token the response shows (chat top_logprobs, completions logprobs); None: the
    # response has no logprobs (``logprobs_count``).
    logprobs: int | None = None
    echo: bool = False  # completions: each choice's text (and logprobs) starts with its prompt's
    prompt_logprobs: int | None = None  # vLLM's field: alternatives per prompt token (non-streamed)


def resolve_model(requested: str | None, names: tuple[str, ...]) -> str:
    if requested is None or requested == "":
        return names[0]
    if requested not in names:
        raise ApiError(404, f"The model `{requested}` does not exist.", param="model")
    return requested


def _in_range(value: float | None, param: str, low: float, high: float) -> None:
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"{param} must be in [{low:g}, {high:g}], got {value:g}", param=param)


def check_ranges(req: _Sampling, max_logprobs: int = MAX_LOGPROBS) -> None:
    """OpenAI's (and vLLM's) ranges of the parameters not checked where their effect is built;
    ``max_logprobs``: ``--max-logprobs``, the cap of every logprobs count."""
    _in_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
    _in_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    rp = req.repetition_penalty
    if rp is not None and not (rp > 0 and math.isfinite(rp)):  # vLLM's bound: finite and > 0
        param = "repetition_penalty"
        raise ApiError(400, f"repetition_penalty must be finite and > 0, got {rp:g}", param=param)
    _in_range(req.min_p, "min_p", 0.0, 1.0)
    if req.logit_bias is not None:
        if len(req.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ApiError(
                400, f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias"
            )
        for token, bias in req.logit_bias.items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ApiError(
                    400,
                    f"logit_bias values must be in [-100, 100], got {bias:g} for token {token}",
                    param="logit_bias",
                )
    check_token_lists(req)
    if req.prompt_logprobs is not None:
        _in_range(req.prompt_logprobs, "prompt_logprobs", 0, max_logprobs)
        if req.stream:  # vLLM's rule and words
            raise ApiError(
                400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
            )
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens < -1:
        raise ApiError(
            400,
            "truncate_prompt_tokens must be -1 (the context window) or >= 0",
            param="truncate_prompt_tokens",
        )
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None:
            _in_range(req.top_logprobs, "top_logprobs", 0, max_logprobs)
            if req.top_logprobs > 0 and not req.logprobs:
                raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        kwargs = req.chat_template_kwargs
        if kwargs is not None and json_depth(kwargs, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ApiError(
                400,
                f"chat_template_kwargs is nested more than {MAX_JSON_DEPTH} levels deep",
                param="chat_template_kwargs",
            )
        if req.continue_final_message and req.add_generation_prompt:
            # vLLM's rule, and its words; add_generation_prompt defaults to true, so it must be sent false.
            raise ApiError(
                400,
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
    elif isinstance(req, CompletionRequest):
        if req.logprobs is not None:
            _in_range(req.logprobs, "logprobs", 0, max_logprobs)
        if req.best_of is not None and req.best_of < req.n:
            raise ApiError(400, f"best_of must be at least n={req.n}, got {req.best_of}", param="best_of")


def check_token_lists(req: _Sampling) -> None:
    """The lists of the logits processors, before the vocabulary is known: vLLM's refusals (an empty
    ``allowed_token_ids``, an empty bad word) and the caps every step's message is sized for."""
    allowed = req.allowed_token_ids
    if allowed is not None:
        if not allowed:
            raise ApiError(400, "allowed_token_ids must not be empty", param="allowed_token_ids")
        if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
            raise ApiError(
                400,
                f"allowed_token_ids may have at most {MAX_ALLOWED_TOKEN_IDS} entries",
                param="allowed_token_ids",
            )
    if req.bad_words:
        if len(req.bad_words) > MAX_BAD_WORDS:
            raise ApiError(400, f"at most {MAX_BAD_WORDS} bad_words are allowed", param="bad_words")
        if not all(word.strip() for word in req.bad_words):
            raise ApiError(400, "bad_words cannot contain an empty string", param="bad_words")


def check_vocabulary(req: _Sampling, vocab_size: int) -> None:
    """Token ids of the logits processors must be in the model's vocabulary (vLLM's check)."""
    if req.logit_bias and max(req.logit_bias) >= vocab_size:
        bad = sorted(t for t in req.logit_bias if t >= vocab_size)[:5]
        raise ApiError(
            400,
            f"logit_bias has out-of-vocabulary token ids {bad} (the vocabulary has {vocab_size})",
            param="logit_bias",
        )
    if req.allowed_token_ids and max(req.allowed_token_ids) >= vocab_size:
        raise ApiError(
            400,
            f"allowed_token_ids must be in [0, {vocab_size}) (the vocabulary)",
            param="allowed_token_ids",
        )


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def bad_words_token_ids(words: list[str], tokenizer: _Encoder, vocab_size: int) -> list[list[int]]:
    """``bad_words`` as token-id sequences, vLLM's way: each word tokenized as written (leading spaces
    stripped) and with one leading space, so it is banned at the start of the text and inside it; the
    spaced form is kept only when it is a different word of as many tokens. Duplicates go. 400 when a
    word tokenizes to nothing, or the sequences exceed the caps (``MAX_BAD_WORDS`` of them,
    ``MAX_BAD_WORDS_TOKENS`` tokens in all) or the vocabulary."""
    sequences: list[list[int]] = []
    for word in dict.fromkeys(words):
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ApiError(400, f"bad word {word!r} tokenizes to no token", param="bad_words")
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    if len(sequences) > MAX_BAD_WORDS:
        raise ApiError(
            400,
            f"bad_words make {len(sequences)} token sequences; at most {MAX_BAD_WORDS} are allowed",
            param="bad_words",
        )
    total = sum(len(s) for s in sequences)
    if total > MAX_BAD_WORDS_TOKENS:
        raise ApiError(
            400,
            f"bad_words make {total} tokens; at most {MAX_BAD_WORDS_TOKENS} are allowed",
            param="bad_words",
        )
    if any(t >= vocab_size for s in sequences for t in s):
        raise ApiError(400, "bad_words tokenize outside the model's vocabulary", param="bad_words")
    return sequences


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    # Counted as sent (empty strings too): the limit bounds the work a request can ask for.
    if len(strings) > MAX_STOP_STRINGS:
        raise ApiError(400, f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in strings):
        raise ApiError(
            400, f"a stop string may be at most {MAX_STOP_STRING_CHARS} characters long", param="stop"
        )
    return tuple(s for s in strings if s)


def check_prompt_options(req: _Sampling, served: ModelConfig, limits: RequestConfig) -> None:
    """What shapes the prompt (``Serving`` renders it), checked before rendering: vLLM's bound on
    ``truncate_prompt_tokens``, and a request's own ``chat_template`` only where the operator trusts
    them (``--trust-request-chat-template``, vLLM's flag)."""
    keep = req.truncate_prompt_tokens
    if keep is not None and keep > served.max_model_len:
        raise ApiError(
            400,
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
            f"({served.max_model_len}). Please, select a smaller truncation size.",
            param="truncate_prompt_tokens",
        )
    if (
        isinstance(req, ChatCompletionRequest)
        and req.chat_template is not None
        and not limits.trust_request_chat_template
    ):
        raise ApiError(
            400,
            "a request's own chat_template is refused unless the server runs with "
            "--trust-request-chat-template (as vLLM's is)",
            param="chat_template",
        )


def output_options(req: _Sampling, served: ModelConfig, limits: RequestConfig) -> OutputOptions:
    model = resolve_model(req.model, served.model_names)
    if not 1 <= req.n <= limits.max_n:
        raise ApiError(400, f"n must be between 1 and {limits.max_n}, got {req.n}", param="n")
    check_ranges(req, limits.max_logprobs)
    refuse_unsupported(req)
    check_prompt_options(req, served, limits)
    stop = _stop_strings(req.stop)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    # vLLM's rule: usage on every chunk is a refinement of include_usage, and means nothing without it.
    continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    if continuous_usage and not include_usage:
        param = "stream_options.continuous_usage_stats"
        raise ApiError(400, "continuous_usage_stats needs include_usage: true", param=param)
    return OutputOptions(
        model=model,
        n=req.n,
        stream=req.stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        return_token_ids=req.return_token_ids,
        stop=stop,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs_count(req),
        echo=isinstance(req, CompletionRequest) and req.echo,
        prompt_logprobs=req.prompt_logprobs,
    )


def logprobs_count(req: _Sampling) -> int | None:
    """How many alternatives per output token a request asks for, None for no logprobs at all. Chat:
    ``logprobs: true`` with ``top_logprobs`` of them (0 if unset); completions: ``logprobs`` itself
    (0 asks for the sampled tokens' own logprobs)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return None


def prompt_logprobs_count(req: _Sampling) -> int | None:
    """Alternatives per prompt token the engine must send: vLLM's ``prompt_logprobs``, and
    completions' ``echo`` with ``logprobs``, which shows the prompt's logprobs, as many as the
    output's (the larger of the two when both ask)."""
    echoed = req.logprobs if isinstance(req, CompletionRequest) and req.echo else None
    asked = [k for k in (echoed, req.prompt_logprobs) if k is not None]
    return max(asked) if asked else None


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
    req: ChatCompletionRequest | CompletionRequest, served: ModelConfig, prompt_len: int
) -> SamplingParams:
    """Engine sampling parameters; ``prompt_len`` bounds max_tokens by the context window."""
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    check_length(prompt_len, served.max_model_len, prompt_param)
    room = served.max_model_len - prompt_len
    max_tokens = requested_max_tokens(req)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise ApiError(
            400,
            f"This model's maximum context length is {served.max_model_len} tokens. However, you "
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
    check_vocabulary(req, served.vocab_size)
    bias = {t: b for t, b in req.logit_bias.items() if b != 0} if req.logit_bias else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=req.seed,
        stop_token_ids=list(stop_ids),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        logit_bias=bias or None,
        allowed_token_ids=list(req.allowed_token_ids) if req.allowed_token_ids else None,
        logprobs=logprobs_count(req),  # chat: logprobs with top_logprobs; completions: logprobs
        prompt_logprobs=prompt_logprobs_count(req),
        # bad_words are tokenized by the caller (``bad_words_token_ids``), off the event loop
    )


def check_length(prompt_len: int, max_model_len: int, param: str = "messages") -> None:
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param=param)
    if prompt_len >= max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {prompt_len} tokens, leaving no room for a completion.",
            param=param,
        )
