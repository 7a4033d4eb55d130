"""The logprobs renderers (``frontend/output/logprobs.py``) and the chunk encoder's logprobs slot,
on hand-made entries: OpenAI's chat and completions shapes, vLLM's prompt_logprobs, partial UTF-8."""

from __future__ import annotations

import math

import msgspec

from trioserve.frontend.output.chunks import ChunkEncoder
from trioserve.frontend.output.logprobs import LogprobsFormat, echo_logprobs
from trioserve.protocol.messages import TokenLogprobs

# A tiny byte vocabulary: 1 "Hi", 2 " there", 3 and 4 the two halves of "é" (0xC3 0xA9), 5 "<|end|>".
VOCAB = {1: b"Hi", 2: b" there", 3: b"\xc3", 4: b"\xa9", 5: b"<|end|>"}
decode = msgspec.json.decode


def fmt(kind: str) -> LogprobsFormat:
    return LogprobsFormat(kind, lambda t: VOCAB.get(t, b""))  # type: ignore[arg-type]


ENTRIES = [
    TokenLogprobs(1, -0.25, 1, [1, 2], [-0.25, -2.0]),
    TokenLogprobs(3, -1.5, 2, [4, 3], [-0.5, -1.5]),
    TokenLogprobs(4, -math.inf, 9, [], []),
]


def test_chat_shape_with_raw_bytes_of_partial_tokens() -> None:
    body = decode(fmt("chat").chat(ENTRIES))
    assert body == {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.25,
                "bytes": [72, 105],
                "top_logprobs": [
                    {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
                    {"token": " there", "logprob": -2.0, "bytes": list(b" there")},
                ],
            },
            {
                "token": "\ufffd",
                "logprob": -1.5,
                "bytes": [0xC3],
                "top_logprobs": [
                    {"token": "\ufffd", "logprob": -0.5, "bytes": [0xA9]},
                    {"token": "\ufffd", "logprob": -1.5, "bytes": [0xC3]},
                ],
            },
            {"token": "\ufffd", "logprob": -9999.0, "bytes": [0xA9], "top_logprobs": []},  # -inf
        ]
    }


def test_completion_shape_and_offsets() -> None:
    body, offset = fmt("completion").completion(ENTRIES[:2], 5)
    assert decode(body) == {
        "tokens": ["Hi", "\ufffd"],
        "token_logprobs": [-0.25, -1.5],
        "top_logprobs": [{"Hi": -0.25, " there": -2.0}, {"\ufffd": -1.5}],  # a dict: same strings merge
        "text_offset": [5, 7],
    }
    assert offset == 8


def test_echo_entries_first_null_and_capped() -> None:
    engine = [None, TokenLogprobs(2, -3.0, 4, [1, 5, 3], [-0.1, -0.2, -0.3])]
    entries = echo_logprobs([1, 2], engine, 1)
    assert [e.top_ids for e in entries] == [[], [1]]
    body, _ = fmt("completion").completion(entries, 0)
    assert decode(body) == {
        "tokens": ["Hi", " there"],
        "token_logprobs": [None, -3.0],
        "top_logprobs": [None, {"Hi": -0.1}],
        "text_offset": [0, 2],
    }
    assert [e.rank for e in echo_logprobs([1, 2], None, 1)] == [0, 0]  # an engine that sent none


def test_prompt_logprobs_vllm_shape() -> None:
    engine = [None, TokenLogprobs(2, -3.0, 4, [1, 2], [-0.1, -3.0])]
    assert decode(fmt("completion").prompt(engine, 2)) == [
        None,
        {
            "2": {"logprob": -3.0, "rank": 4, "decoded_token": " there"},
            "1": {"logprob": -0.1, "rank": 1, "decoded_token": "Hi"},
        },
    ]


def test_chunk_encoder_logprobs_slot() -> None:
    for kind in ("chat", "completion"):
        enc = ChunkEncoder(kind, "id", 1, "m", False)
        plain = decode(enc.delta(0, "Hi", [1]))
        assert plain["choices"][0]["logprobs"] is None
        lp = fmt(kind).chat(ENTRIES[:1]) if kind == "chat" else fmt(kind).completion(ENTRIES[:1], 0)[0]
        chunk = decode(enc.delta(0, "Hi", [1], "stop", None, 0, lp))
        choice = chunk["choices"][0]
        assert choice["logprobs"] == decode(lp) and choice["finish_reason"] == "stop"
        assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == "Hi"
