"""Structured output through the pure scheduler and the model runner, on a tiny random Llama with
Qwen3's tokenizer: whatever the random weights prefer, every constrained output matches its grammar
(checked by a validator, not by eye) and ends with EOS; seeded outputs are the same with and without
preemptions (the matcher takes a resumed request's outputs in again, once each); the unconstrained
requests beside them get exactly the tokens they get alone; and a request cut by ``max_tokens``
finishes by ``length`` with a prefix its grammar accepts."""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Literal

import pydantic
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trioserve.frontend.request.structured import GrammarCache, GrammarSource, checked_grammar
from trioserve.frontend.text.tokenizer import Tokenizer, load_tokenizer
from trioserve.worker.grammar import GrammarBook

from .test_model_runner import Engine


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    kind: Literal["cat", "dog", "owl"]
    age: int = pydantic.Field(ge=0, le=30)
    tags: list[Literal["calm", "loud"]] = pydantic.Field(max_length=2)


REGEX = r"[a-z]{2,6}@[a-z]{3}\.(com|org)"
CHOICES = ["yes", "no", "perhaps not"]
SOURCES = {
    "json": GrammarSource("json_schema", json.dumps(Pet.model_json_schema()), "t"),
    "regex": GrammarSource("regex", REGEX, "t"),
    "choice": GrammarSource("choice", json.dumps(CHOICES), "t"),
}


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        Pet.model_validate_json(text, strict=True)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, GrammarBook, Any]:
    tokenizer = load_tokenizer(None)
    folder = tmp_path_factory.mktemp("qwen3-tokenizer")
    tokenizer.hf_tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).eval()
    # One book for every engine here: its tokenizer view (seconds for 151k tokens) is built once.
    return tokenizer, GrammarBook(str(folder), tokenizer.vocab_size), model


GRAMMARS = {kind: checked_grammar(GrammarCache(), source) for kind, source in SOURCES.items()}


def engine_with(book: GrammarBook, model: Any, **limits: Any) -> Engine:
    engine = Engine(model, book.tokenizer_path, max_model_len=256, **limits)
    engine.runner.grammars = book
    return engine


def run(qwen3: tuple[Tokenizer, GrammarBook, Any], kinds: list[str], plain: int, **limits: Any) -> Engine:
    tokenizer, book, model = qwen3
    engine = engine_with(book, model, **limits)
    eos = tokenizer.eos_token_id
    # Plain ones first: the scheduler preempts the newest, so the constrained ones are the victims.
    for i in range(plain):
        engine.add(f"plain-{i}", [400 + i, 500, 600 + i], 24, eos, temperature=1.0, seed=1000 + i)
    for i, kind in enumerate(kinds):
        prompt = [100 + i, 200 + 7 * i, 300]
        engine.add(f"{kind}-{i}", prompt, 96, eos, temperature=1.0, seed=i, grammar=GRAMMARS[kind])
    engine.run()
    return engine


KINDS = ["json", "regex", "choice", "json", "regex", "json"]


def test_every_constrained_output_matches_and_ends_at_eos(qwen3: tuple[Tokenizer, GrammarBook, Any]) -> None:
    tokenizer = qwen3[0]
    engine = run(qwen3, KINDS, plain=2)
    for i, kind in enumerate(KINDS):
        rid = f"{kind}-{i}"
        tokens = engine.tokens[rid]
        assert engine.finish[rid] == "stop" and tokens[-1] == tokenizer.eos_token_id, (rid, tokens)
        text = tokenizer.decode(tokens[:-1])
        assert valid(kind, text), (rid, text)


def test_preemption_and_neighbours_change_nothing(qwen3: tuple[Tokenizer, GrammarBook, Any]) -> None:
    roomy = run(qwen3, KINDS, plain=2)
    tight = run(
        qwen3, KINDS, plain=2, num_blocks=28
    )  # 4-token blocks, one request needs 25: preempts and resumes
    assert tight.preemptions > 0
    assert tight.tokens == roomy.tokens
    alone = run(qwen3, [], plain=2)
    for rid, tokens in alone.tokens.items():
        assert roomy.tokens[rid] == tokens


def test_a_length_finish_is_a_prefix_the_grammar_accepts(qwen3: tuple[Tokenizer, GrammarBook, Any]) -> None:
    tokenizer, book, model = qwen3
    engine = engine_with(book, model)
    engine.add(
        "short", [100, 200], 5, tokenizer.eos_token_id, temperature=1.0, seed=3, grammar=GRAMMARS["json"]
    )
    engine.run()
    assert engine.finish["short"] == "length" and len(engine.tokens["short"]) == 5
    fresh = book.state(GRAMMARS["json"], tokenizer.eos_token_id)
    book.ready(fresh)
    matcher = fresh.matcher
    assert matcher.consume_tokens(engine.tokens["short"]) and not matcher.is_error()
    assert tokenizer.decode(engine.tokens["short"]).startswith("{")


def test_a_new_requests_matcher_is_built_beside_the_forward(
    qwen3: tuple[Tokenizer, GrammarBook, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh request has no outputs to take in before its first forward, so its matcher is built on
    the mask thread; a resumed one builds its own before the forward, on the step's thread."""
    tokenizer, book, model = qwen3
    builds: list[str] = []
    ready = book.ready

    def recorded(state: Any) -> None:
        if state.grammar is not None:
            builds.append(threading.current_thread().name)
        ready(state)

    monkeypatch.setattr(book, "ready", recorded)
    engine = engine_with(book, model)
    engine.add(
        "fresh", [100, 200], 8, tokenizer.eos_token_id, temperature=1.0, seed=4, grammar=GRAMMARS["regex"]
    )
    engine.run()
    assert builds and all(name.startswith("grammar-masks") for name in builds)
    builds.clear()
    tight = run(qwen3, KINDS, plain=2, num_blocks=28)
    assert tight.preemptions > 0
    assert "MainThread" in builds  # resumed requests with outputs, before their forward
