from __future__ import annotations

import pytest

from trioserve.frontend.text.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Tokenizer:
    # Built once per machine (a few seconds), then loaded from the user cache (~0.6 s).
    return load_tokenizer(None)
