"""The hot-path shortcuts (table detokenizer, tiktoken encoder) agree with the reference paths."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.frontend.text.byte_detokenizer import ByteLevelDetokenizer, ByteLevelTables
from trioserve.frontend.text.detokenizer import IncrementalDetokenizer
from trioserve.frontend.text.tokenizer import Tokenizer

SPLIT_EMOJI = [9284, 104, 254]  # 🫠 as three byte-level tokens


@pytest.fixture(scope="module")
def tables(qwen3_tokenizer: Tokenizer) -> ByteLevelTables:
    built = ByteLevelTables.build(qwen3_tokenizer.hf_tokenizer.backend_tokenizer)
    assert built is not None
    return built


def test_the_builtin_tokenizer_uses_the_table_path(qwen3_tokenizer: Tokenizer) -> None:
    assert isinstance(qwen3_tokenizer.detokenizer(), ByteLevelDetokenizer)


def test_split_character_is_held_until_complete(tables: ByteLevelTables) -> None:
    detok = ByteLevelDetokenizer(tables)
    assert [detok.step(i) for i in SPLIT_EMOJI] == ["", "", "🫠"]
    assert detok.step(9707) == "Hello"  # the fast path resumes after the slow one


ids_strategy = st.lists(
    st.one_of(
        st.integers(0, 151668),
        st.sampled_from([*SPLIT_EMOJI, 151643, 151645, 151667, 151668]),
        st.integers(151669, 200000),
        st.integers(-5, -1),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ids=ids_strategy, skip=st.booleans())
def test_matches_decode_stream_and_full_decode(
    qwen3_tokenizer: Tokenizer, tables: ByteLevelTables, ids: list[int], skip: bool
) -> None:
    fast = ByteLevelDetokenizer(tables, skip_special_tokens=skip).step_many(ids)
    full = qwen3_tokenizer.decode(ids, skip_special_tokens=skip)
    if full.endswith("\ufffd"):  # ends mid-character: the stream holds those bytes back
        assert full.startswith(fast)
        return
    assert fast == full
    reference = IncrementalDetokenizer(
        qwen3_tokenizer.hf_tokenizer.backend_tokenizer, skip_special_tokens=skip
    )
    assert fast == "".join(reference.step(i) for i in ids)


def test_non_byte_level_tokenizers_get_no_tables() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    assert ByteLevelTables.build(backend) is None


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 151668), max_size=64))
def test_fast_encoder_matches_the_rust_backend(qwen3_tokenizer: Tokenizer, ids: list[int]) -> None:
    # Text from random ids (special tokens included) re-encodes to the same ids both ways.
    text = qwen3_tokenizer.decode(ids, skip_special_tokens=False)
    backend = qwen3_tokenizer.hf_tokenizer.backend_tokenizer
    assert qwen3_tokenizer.encode(text) == backend.encode(text, add_special_tokens=True).ids
