"""Request bodies of the OpenAI-compatible routes, decoded and type-checked by msgspec.

Rule: a parameter the server accepts is never silently ignored. Every struct forbids unknown fields,
so a field not declared here is a 400 that names it. Every declared field is one of:

- a field with an effect (tests/unit/test_request_schema.py maps each to the code that implements it);
- informational (``validate.INFORMATIONAL_FIELDS``): accepted at any value, with the reason it has no
  server-side effect even at OpenAI's own servers or here;
- not supported yet (``validate.UNSUPPORTED_FIELDS``): accepted only at the value that means what the
  server does anyway (clients such as LangChain send neutral defaults), refused with a 400 naming it
  otherwise. Range checks run before that refusal, so they stay right when the feature lands.

Adding a field means adding it to one of those tables; the schema test fails otherwise. Wrong types are
a 400 with msgspec's message, which names the offending path (``$.messages[0].role``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

# Integer fields are bounded at decode time: an out-of-range value is a 400 naming the field, never an
# overflow deeper in (msgpack carries at most 64-bit integers to the engine).
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
# OpenAI's limits on ``metadata``: 16 pairs, keys up to 64 characters, values up to 512.
_MetaKey = Annotated[str, msgspec.Meta(max_length=64)]
_MetaValue = Annotated[str, msgspec.Meta(max_length=512)]
Metadata = Annotated[dict[_MetaKey, _MetaValue], msgspec.Meta(max_length=16)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk (with include_usage)
    include_obfuscation: bool | None = None  # OpenAI: random padding on chunks (not supported yet)


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    """A content part; only text is served (an ``image_url`` part is a 400 naming ``type``)."""

    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    # Tool calling is not supported yet (see ``tools``); declared so that a request replaying a tool
    # conversation is refused with a message that says so, and so the content rule can name them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # What an assistant message replayed from a response (the openai SDK's ``model_dump()``) carries;
    # accepted at their empty values, refused otherwise (not supported yet).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
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
    user: str | None = None  # informational
    presence_penalty: float | None = None  # -2..2
    frequency_penalty: float | None = None  # -2..2
    logit_bias: dict[TokenId, float] | None = None  # JSON keys are token ids written as strings
    # Structured output (frontend/request/structured.py reads these four groups; at most one is set)
    response_format: dict[str, Any] | None = None
    # vLLM extensions
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    priority: Count = 0
    # trioserve: this request's deadline without output, in ms (docs/replicas.md); 0/None: none
    timeout_ms: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)] | None = None
    truncate_prompt_tokens: Count | None = None  # keep the prompt's last k tokens (-1: the context window)
    # vLLM's logits processors (the worker's sampler applies them; docs/openai_api.md)
    repetition_penalty: float | None = None  # > 0, over prompt and output tokens
    min_p: float | None = None  # 0..1
    bad_words: list[str] | None = None  # tokenized in the API server, as vLLM does
    allowed_token_ids: list[TokenId] | None = None  # only these may be sampled
    prompt_logprobs: Count | None = None
    # vLLM's structured output, and its older guided_* names
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # informational
    metadata: Metadata | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # not supported yet
    modalities: list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM extensions
    continue_final_message: bool | None = None  # end the prompt inside the final message's text
    chat_template: str | None = None  # under --trust-request-chat-template only


class CompletionRequest(_Sampling, kw_only=True):
    # str, list[str], list[int] or list[list[int]]; msgspec unions allow one array type, so the
    # list's shape is checked when the prompt is rendered.
    prompt: str | list[str | TokenId | list[TokenId]]
    # not supported yet
    echo: bool = False
    logprobs: Count | None = None  # an int here: 0 asks for the sampled tokens' logprobs
    best_of: Count | None = None
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered with messages, as a chat request's are
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[TokenId]
    model: str | None = None
