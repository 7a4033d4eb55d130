"""The request fields that shape the prompt, checked without a server: ``truncate_prompt_tokens``
(vLLM's bound), ``continue_final_message`` (vLLM's rule with ``add_generation_prompt``), a request's
``chat_template`` (only under ``--trust-request-chat-template``), and the refusals of ``suffix`` and
``best_of`` (each message says why, as vLLM does)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from trioserve.config import ModelConfig, RequestConfig
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import ChatCompletionRequest, CompletionRequest
from trioserve.frontend.request.validate import UNSUPPORTED_FIELDS, decode_body, output_options

MODEL = ModelConfig(max_model_len=512)
LIMITS = RequestConfig()
TRUSTING = RequestConfig(trust_request_chat_template=True)
USER = [{"role": "user", "content": "hi"}]


def check(body: dict[str, Any], limits: RequestConfig = LIMITS) -> None:
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    output_options(decode_body(msgspec.json.encode(body), kind), MODEL, limits)


def refused(body: dict[str, Any], limits: RequestConfig = LIMITS) -> ApiError:
    with pytest.raises(ApiError) as info:
        check(body, limits)
    assert info.value.status == 400
    return info.value


def test_prompt_fields_are_implemented_not_refused() -> None:
    for name in ("continue_final_message", "chat_template", "truncate_prompt_tokens"):
        assert name not in UNSUPPORTED_FIELDS


@pytest.mark.parametrize("keep", [-1, 0, 1, 512])
def test_truncate_prompt_tokens_accepted(keep: int) -> None:
    check({"prompt": "x", "truncate_prompt_tokens": keep})
    check({"messages": USER, "truncate_prompt_tokens": keep})


def test_truncate_prompt_tokens_bounds() -> None:
    error = refused({"prompt": "x", "truncate_prompt_tokens": 513})
    assert error.param == "truncate_prompt_tokens"
    assert error.message == (
        "truncate_prompt_tokens value (513) is greater than max_model_len (512). "
        "Please, select a smaller truncation size."
    )
    assert refused({"prompt": "x", "truncate_prompt_tokens": -2}).param == "truncate_prompt_tokens"


def test_continue_final_message_needs_add_generation_prompt_false() -> None:
    body = {"messages": USER, "continue_final_message": True}
    error = refused(body)  # add_generation_prompt defaults to true, as in vLLM
    assert error.param == "continue_final_message"
    assert error.message == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    check({**body, "add_generation_prompt": False})
    check({"messages": USER, "continue_final_message": False})


def test_a_request_chat_template_needs_trust() -> None:
    body = {"messages": USER, "chat_template": "{{ messages }}"}
    error = refused(body)
    assert error.param == "chat_template" and "--trust-request-chat-template" in error.message
    check(body, TRUSTING)
    check({"messages": USER, "chat_template": None})  # null is no template


def test_suffix_and_best_of_refusals_say_why() -> None:
    suffix = refused({"prompt": "x", "suffix": "!"})
    assert suffix.param == "suffix" and "vLLM refuses it too" in suffix.message
    check({"prompt": "x", "suffix": ""})
    best_of = refused({"prompt": "x", "best_of": 3, "n": 2})
    assert best_of.param == "best_of" and "V1 engine removed best_of" in best_of.message
    check({"prompt": "x", "best_of": 2, "n": 2})
    assert refused({"prompt": "x", "best_of": 1, "n": 2}).param == "best_of"  # below n: a range error
