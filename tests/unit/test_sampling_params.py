"""The logits processors of the worker's sampler (``worker/sampler.py``): each equals transformers' own
processor on the same logits (presence and frequency penalties OpenAI's formula, which transformers
lacks), all of them together equal transformers' processors chained in the sampler's order, rows with
different settings side by side equal each row alone, rows that use none cost nothing (no stage runs),
and through the scheduler and the runner on a tiny random model: greedy output with a repetition
penalty and a logit bias equals ``generate()`` with the same, and a seed gives the same tokens with
every parameter on, alone, batched with chunked prefill, after a prefix-cache hit and after preemption.
Plus what the API server makes of the parameters (bad words tokenized vLLM's way), the mock engine
accepting them, and the worst-case step with every list at its cap fitting the ring's slot.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import msgspec
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tests.unit.test_model_runner import VOCAB, Engine, prompt, tiny_model
from tests.unit.test_worker_executor import BIG, WORST, worst_case_step_frame
from trioserve.config import ModelConfig, RequestConfig
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.openai_schema import ChatCompletionRequest, CompletionRequest
from trioserve.frontend.request.validate import (
    bad_words_token_ids,
    decode_body,
    output_options,
    sampling_params,
)
from trioserve.frontend.text.tokenizer import load_tokenizer
from trioserve.mock.core import MockCore
from trioserve.protocol.messages import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOKENS,
    MAX_GRAMMARS_PER_STEP,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    AddRequest,
    SamplingParams,
)
from trioserve.protocol.step import step_slot_bytes
from trioserve.worker import sampler as sampler_module
from trioserve.worker.sampler import RequestProcessors, Sampler, SamplingRow

V = 200  # vocabulary of the sampler-only tests
CPU = torch.device("cpu")


def random_logits(seed: int, rows: int = 1, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def ids(seed: int, n: int, vocab: int = V) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    out: list[int] = torch.randint(0, vocab, (n,), generator=g).tolist()
    return out


def with_history(
    sampler: Sampler, prompt_ids: list[int], outputs: list[int], **params: Any
) -> RequestProcessors | None:
    """A request's processors after its prompt and ``outputs`` went through the runner (in chunks,
    as chunked prefill and decodes hand them over)."""
    p = sampler.processors(SamplingParams(max_tokens=64, **params), len(prompt_ids))
    if p is not None:
        tokens = prompt_ids + outputs
        for start in range(0, len(tokens), 7):
            sampler.record([(p, tokens[start : start + 7])])
    return p


def hf(processor: LogitsProcessor, context: list[int], logits: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = processor(torch.tensor([context]), logits.clone())
    return out


# ---- each processor against transformers' ------------------------------------------------------------


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    prompt_ids, outputs = ids(1, 30), ids(2, 20)
    logits = random_logits(3)
    sampler = Sampler(CPU, V)
    p = with_history(sampler, prompt_ids, outputs, repetition_penalty=penalty)
    ours = sampler.process(logits.clone(), [SamplingRow(1.0, processors=p)])
    # transformers' reads the whole context, prompt and output, as vLLM's does.
    expected = hf(RepetitionPenaltyLogitsProcessor(penalty), prompt_ids + outputs, logits)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert not torch.equal(ours, logits)


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.8), (-1.5, 2.0), (2.0, -2.0)])
def test_presence_and_frequency_penalties_are_openais_formula(presence: float, frequency: float) -> None:
    prompt_ids = [5, 6, 7, 8]  # prompt tokens are not penalized (OpenAI: the output so far)
    outputs = [1, 1, 1, 2, 9, 9, 5]
    logits = random_logits(4)
    sampler = Sampler(CPU, V)
    p = with_history(sampler, prompt_ids, outputs, presence_penalty=presence, frequency_penalty=frequency)
    ours = sampler.process(logits.clone(), [SamplingRow(1.0, processors=p)])
    counts = torch.bincount(torch.tensor(outputs), minlength=V).float()
    expected = logits[0] - counts * frequency - (counts > 0).float() * presence
    torch.testing.assert_close(ours[0], expected)
    assert torch.equal(ours[0, [6, 7, 8]], logits[0, [6, 7, 8]])


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_min_p_equals_transformers(min_p: float, temperature: float) -> None:
    logits = random_logits(5)
    ours = Sampler(CPU, V).warp(logits.clone(), [SamplingRow(temperature, min_p=min_p)])
    scaled = hf(TemperatureLogitsWarper(temperature), [], logits)
    expected = hf(MinPLogitsWarper(min_p), [], scaled)
    assert torch.equal(ours.isinf(), expected.isinf())
    kept = ~expected.isinf()
    torch.testing.assert_close(ours[kept], expected[kept])
    assert bool(kept.any())


@pytest.mark.parametrize("seed", range(6))
def test_min_p_row_by_row_keeps_exactly_the_rule(seed: int) -> None:
    """The CPU path (``threshold_`` just below each row's threshold) against the rule itself, on
    logits on a coarse grid (many ties, some exactly at a threshold), some -inf, some rows without
    min_p, greedy rows, and min_p 1.0 (only the top tokens stay)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(8, V, generator=g) * 4).round() / 4  # quarter steps: ties everywhere
    logits[2, ::7] = float("-inf")
    min_ps = [0.0, 0.05, 0.3, 1.0, 0.0, math.exp(-0.5), 0.9, 0.05]  # exp(-0.5): thresholds on the grid
    rows = [SamplingRow(1.0, min_p=m) for m in min_ps]
    rows[7] = SamplingRow(0.0, min_p=0.05)  # greedy: not cut
    ours = Sampler(CPU, V).warp(logits.clone(), rows)
    for i, (row, m) in enumerate(zip(logits, min_ps, strict=True)):
        if m == 0.0 or i == 7:
            assert torch.equal(ours[i], row)
            continue
        threshold = row.amax() + torch.tensor(math.log(m))
        assert torch.equal(ours[i], row.masked_fill(row < threshold, float("-inf"))), i
        assert ours[i].amax() == row.amax()


BAD_WORDS = [[4], [10, 11], [20, 21, 22], [30, 11]]


@pytest.mark.parametrize(
    "outputs",
    [[], [10], [3, 10], [20, 21], [20], [21, 20, 21], [30], [10, 30], [5, 6, 7]],
    ids=lambda o: "-".join(map(str, o)) or "none",
)
def test_bad_words_equal_transformers_over_the_output(outputs: list[int]) -> None:
    logits = random_logits(6)
    prompt_ids = [10, 20, 21]  # vLLM matches the output only: a prompt ending in a prefix bans nothing
    sampler = Sampler(CPU, V)
    p = with_history(sampler, prompt_ids, outputs, bad_words_token_ids=BAD_WORDS)
    ours = sampler.process(logits.clone(), [SamplingRow(1.0, processors=p)])
    expected = hf(NoBadWordsLogitsProcessor(BAD_WORDS), outputs, logits) if outputs else logits.clone()
    if not outputs:
        expected[0, 4] = float("-inf")  # transformers needs a context; a one-token word is always banned
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    bias = {3: 5.0, 17: -100.0, 42: 0.5, 199: -2.25}
    logits = random_logits(7)
    sampler = Sampler(CPU, V)
    p = sampler.processors(SamplingParams(max_tokens=4, logit_bias=bias), 3)
    ours = sampler.process(logits.clone(), [SamplingRow(1.0, processors=p)])
    expected = hf(SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]), [1, 2, 3], logits)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_allowed_token_ids_equal_transformers_prefix_constraint() -> None:
    allowed = [0, 7, 8, 150, 199]
    logits = random_logits(8)
    sampler = Sampler(CPU, V)
    p = sampler.processors(SamplingParams(max_tokens=4, allowed_token_ids=allowed), 3)
    ours = sampler.process(logits.clone(), [SamplingRow(1.0, processors=p)])
    constraint = PrefixConstrainedLogitsProcessor(lambda _batch, _ids: allowed, num_beams=1)
    expected = hf(constraint, [1, 2, 3], logits)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    draws = {sampler.sample(logits.clone(), [SamplingRow(2.0, processors=p)])[0] for _ in range(200)}
    assert draws <= set(allowed) and len(draws) > 1


ALL = dict(
    presence_penalty=0.4,
    frequency_penalty=0.3,
    repetition_penalty=1.25,
    logit_bias={12: 3.0, 13: -4.0, 100: 2.0},
    allowed_token_ids=[*range(0, V, 2), 13],
    bad_words_token_ids=[[14], [30, 40], [6, 8]],
)


def test_all_together_equal_transformers_chained_in_the_samplers_order() -> None:
    """allowed, bad words, logit_bias, repetition, presence/frequency; temperature, min_p, top-k, top-p."""
    prompt_ids, outputs = ids(9, 25), [*ids(10, 15), 30, 6]  # both bad words' prefixes end the output
    logits = random_logits(11)
    sampler = Sampler(CPU, V)
    p = with_history(sampler, prompt_ids, outputs, **ALL)
    row = SamplingRow(0.8, top_p=0.9, top_k=40, min_p=0.02, processors=p)
    ours = sampler.warp(sampler.process(logits.clone(), [row]), [row])

    allowed = ALL["allowed_token_ids"]
    x = hf(PrefixConstrainedLogitsProcessor(lambda _b, _i: allowed, num_beams=1), outputs, logits)  # type: ignore[arg-type, return-value]
    x = hf(NoBadWordsLogitsProcessor(ALL["bad_words_token_ids"]), outputs, x)  # type: ignore[arg-type]
    x = hf(SequenceBiasLogitsProcessor([[[t], b] for t, b in ALL["logit_bias"].items()]), outputs, x)  # type: ignore[attr-defined]
    x = hf(RepetitionPenaltyLogitsProcessor(1.25), prompt_ids + outputs, x)
    counts = torch.bincount(torch.tensor(outputs), minlength=V).float()
    x = x - 0.3 * counts - 0.4 * (counts > 0).float()
    for warper in (TemperatureLogitsWarper(0.8), MinPLogitsWarper(0.02), TopKLogitsWarper(40)):
        x = hf(warper, outputs, x)
    x = hf(TopPLogitsWarper(0.9), outputs, x)
    assert torch.equal(ours.isinf(), x.isinf())
    kept = ~x.isinf()
    torch.testing.assert_close(ours[kept], x[kept])
    assert ours[0, 8] == float("-inf") and ours[0, 40] == float("-inf")  # the bad words' last tokens


# ---- batches ----------------------------------------------------------------------------------------

SETTINGS: list[dict[str, Any]] = [
    {},
    {"presence_penalty": 1.0},
    {"frequency_penalty": -0.5, "repetition_penalty": 0.8},
    {"repetition_penalty": 1.5, "logit_bias": {5: 10.0}},
    {"allowed_token_ids": [1, 2, 3, 50, 60]},
    {"bad_words_token_ids": [[7], [8, 9]]},
    ALL,
    {},
]
ROW_OPTIONS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 1},
    {"temperature": 0.7, "min_p": 0.1, "seed": 2},
    {"temperature": 1.3, "top_k": 20, "seed": 3},
    {"temperature": 0.0},
    {"temperature": 1.0, "top_p": 0.8, "min_p": 0.3, "seed": 4},
    {"temperature": 0.9, "min_p": 0.05, "top_k": 50, "top_p": 0.95, "seed": 5},
    {"temperature": 1.0, "seed": 6},
]


def batch_rows(sampler: Sampler, which: list[int]) -> list[SamplingRow]:
    rows = []
    for i in which:
        outputs = [*ids(20 + i, 9), 8]
        p = with_history(sampler, ids(40 + i, 12), outputs, **SETTINGS[i])
        rows.append(SamplingRow(**ROW_OPTIONS[i], output_index=len(outputs), processors=p))
    return rows


def test_rows_side_by_side_equal_each_row_alone() -> None:
    everyone = list(range(len(SETTINGS)))
    logits = random_logits(12, rows=len(everyone))
    batch = Sampler(CPU, V)
    rows = batch_rows(batch, everyone)
    processed = batch.process(logits.clone(), rows)
    warped = batch.warp(processed.clone(), rows)
    tokens = batch.sample(logits.clone(), rows)
    for i in everyone:
        alone = Sampler(CPU, V)
        (row,) = batch_rows(alone, [i])
        one = logits[i : i + 1].clone()
        assert torch.equal(alone.process(one.clone(), [row])[0], processed[i]), i
        assert torch.equal(alone.warp(alone.process(one.clone(), [row]), [row])[0], warped[i]), i
        assert alone.sample(one, [row]) == [tokens[i]], i
    assert len(set(map(tuple, processed.tolist()))) == len(everyone)  # every setting did something


def test_rows_that_use_nothing_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = Sampler(CPU, V)
    neutral = SamplingParams(
        max_tokens=4, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}
    )
    assert sampler.processors(neutral, 3) is None  # no state, no pool row
    assert sampler.processors(SamplingParams(max_tokens=4, bad_words_token_ids=[]), 3) is None
    assert sampler.token_counts.capacity == 0

    def never(*_: Any) -> None:
        raise AssertionError("a stage ran for rows that do not use it")

    for stage in ("_keep_only", "_min_p", "_row_index"):
        monkeypatch.setattr(sampler_module, stage, never)
    monkeypatch.setattr(Sampler, "_penalize", never)
    logits = random_logits(13, rows=4)
    rows = [SamplingRow(0.0), SamplingRow(1.0, seed=3), SamplingRow(0.5, top_k=5), SamplingRow(1.0)]
    assert torch.equal(sampler.process(logits.clone(), rows), logits)
    sampler.sample(logits.clone(), rows)


def test_pool_rows_are_reused_and_start_clean() -> None:
    sampler = Sampler(CPU, V)
    first = with_history(sampler, [1, 2], [3, 3], presence_penalty=1.0)
    assert first is not None and first.slot is not None
    slot = first.slot
    sampler.release(first)
    again = with_history(sampler, [9], [], repetition_penalty=1.5)
    assert again is not None and again.slot == slot
    assert sampler.token_counts.seen_of(again) == [9]
    assert float(sampler.token_counts.out_counts[slot].sum()) == 0  # the old counts are gone
    many = [with_history(sampler, [1], [2, 2, 3], frequency_penalty=1.0) for _ in range(20)]  # rows grow
    long = with_history(sampler, list(range(150)), [7] * 5 + list(range(100, 199)), presence_penalty=1.0)
    assert long is not None
    assert sampler.token_counts.capacity >= 22
    assert sampler.token_counts.seen_of(again) == [9]  # rows survive the growth, in rows and columns
    assert all(p is not None and sampler.token_counts.counts_of(p) == {2: 2.0, 3: 1.0} for p in many)
    assert sampler.token_counts.counts_of(long) == {7: 5.0, **{t: 1.0 for t in range(100, 199)}}


def test_ids_outside_the_vocabulary_are_dropped_not_a_crash() -> None:
    sampler = Sampler(CPU, V)
    p = sampler.processors(
        SamplingParams(
            max_tokens=4,
            logit_bias={V + 1: 5.0, 3: 1.0},
            allowed_token_ids=[V, 3, 4],
            bad_words_token_ids=[[V]],
        ),
        2,
    )
    logits = random_logits(14)
    out = sampler.process(logits.clone(), [SamplingRow(1.0, banned=(V + 7,), processors=p)])
    assert out[0, 3] == logits[0, 3] + 1.0 and out[0, 4] == logits[0, 4]
    assert int((~out.isinf()).sum()) == 2


def test_seeded_draws_with_every_parameter_are_reproducible() -> None:
    logits = random_logits(15)
    draws = []
    for _ in range(2):
        sampler = Sampler(CPU, V)
        p = with_history(sampler, ids(16, 10), ids(17, 10), **ALL)
        row = SamplingRow(1.0, top_p=0.95, top_k=60, seed=77, output_index=10, min_p=0.01, processors=p)
        draws.append([sampler.sample(logits.clone(), [row]) for _ in range(5)])
    assert draws[0] == draws[1]


# ---- through the scheduler and the runner, on a tiny random model ----------------------------------


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param)


def generate(model: Any, prompt_ids: list[int], max_tokens: int, **kwargs: Any) -> list[int]:
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return list(out[0, len(prompt_ids) :].tolist())


REPETITIVE = [5, 6, 7, 8] * 4  # a prompt whose greedy continuation repeats it
BIAS = {9: 2.5, 10: -3.0}


def test_greedy_with_repetition_penalty_and_logit_bias_equals_generate(model: Any) -> None:
    prompts = {"rep": REPETITIVE, **{f"p{i}": prompt(80 + i, 6 + 5 * i) for i in range(3)}}
    sequence_bias = [[[t], b] for t, b in BIAS.items()]
    expected = {
        rid: generate(model, p, 12, repetition_penalty=1.8, sequence_bias=sequence_bias)
        for rid, p in prompts.items()
    }
    plain = generate(model, REPETITIVE, 12)
    assert expected["rep"] != plain  # the penalty is visible on this prompt
    engine = Engine(model, max_num_batched_tokens=16)  # chunked prefill, mixed with decodes
    for rid, p in prompts.items():
        engine.add(rid, p, 12, repetition_penalty=1.8, logit_bias=BIAS)
    engine.add("plain", REPETITIVE, 12)  # side by side with one that uses nothing
    got = engine.run()
    assert got.pop("plain") == plain
    assert got == expected


def run_checking_histories(engine: Engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """``engine.run()``, checking after every step that each history-keeping request's sampler state
    holds exactly its tokens so far: the distinct tokens of its prompt and output, its outputs' counts."""
    runner = engine.runner
    counts = runner.sampler.token_counts
    for _ in range(1000):
        if not engine.scheduler.has_work:
            return engine.tokens
        engine.step()
        for rid, seq in runner.sequences.items():
            p = seq.processors
            if p is None or p.slot is None:
                continue
            known = [*prompts[rid], *engine.tokens[rid]][: p.num_seen]
            n = len(prompts[rid])
            assert p.num_seen >= n or not engine.tokens[rid]
            if p.seen is not None:
                assert counts.seen_of(p) == list(dict.fromkeys(known)), rid
            if p.out_cols is not None:
                assert counts.counts_of(p) == {t: float(c) for t, c in Counter(known[n:]).items()}, rid
    raise AssertionError("did not finish")


def test_history_survives_a_prefix_cache_hit_and_preemption(model: Any) -> None:
    """The tokens before a new request's first computed one come from the runner's slot-token
    mirror: after a prefix-cache hit, and when a preempted request comes back."""
    sequence_bias = [[[t], b] for t, b in BIAS.items()]
    prompts = {f"q{i}": [*REPETITIVE, *prompt(90 + i, 4)] for i in range(3)}
    expected = {
        rid: generate(model, p, 14, repetition_penalty=1.5, sequence_bias=sequence_bias)
        for rid, p in prompts.items()
    }
    cached = Engine(model)
    cached.add("warm", REPETITIVE, 2)
    cached.run()
    cached.add("q0", prompts["q0"], 14, repetition_penalty=1.5, logit_bias=BIAS)
    assert run_checking_histories(cached, {**prompts, "warm": REPETITIVE})["q0"] == expected["q0"]
    assert cached.cached["q0"] == 16  # REPETITIVE's four blocks came from the cache

    tight = Engine(model, num_blocks=14)  # 3 x 32 tokens do not fit 14 blocks of 4: preemption
    for rid, p in prompts.items():
        tight.add(rid, p, 14, repetition_penalty=1.5, logit_bias=BIAS)
    assert run_checking_histories(tight, prompts) == expected
    assert tight.preemptions > 0


EVERYTHING = dict(
    temperature=1.0,
    top_p=0.95,
    top_k=100,
    min_p=0.02,
    presence_penalty=0.6,
    frequency_penalty=0.4,
    repetition_penalty=1.3,
    logit_bias={3: 4.0, 7: -100.0},
    allowed_token_ids=list(range(1, 300)),
    bad_words_token_ids=[[11], [20, 21]],
)


def test_a_seed_with_every_parameter_gives_the_same_tokens_anywhere(model: Any) -> None:
    seeds = {f"s{i}": 1000 + i for i in range(3)}
    prompts = {rid: [*REPETITIVE, *prompt(100 + i, 4)] for i, rid in enumerate(seeds)}

    def alone(rid: str) -> list[int]:
        engine = Engine(model)
        engine.add(rid, prompts[rid], 14, seed=seeds[rid], **EVERYTHING)
        return engine.run()[rid]

    solo = {rid: alone(rid) for rid in seeds}
    for tokens in solo.values():
        assert all(1 <= t < 300 and t not in (7, 11) for t in tokens)
    assert len(set(map(tuple, solo.values()))) == 3

    crowded = Engine(model, max_num_batched_tokens=8)
    for i in range(3):
        crowded.add(f"other{i}", prompt(110 + i, 9), 14, temperature=1.0)
    for rid, seed in seeds.items():
        crowded.add(rid, prompts[rid], 14, seed=seed, **EVERYTHING)
    got = run_checking_histories(crowded, prompts)
    assert {rid: got[rid] for rid in seeds} == solo

    tight = Engine(model, num_blocks=14)
    for rid, seed in seeds.items():
        tight.add(rid, prompts[rid], 14, seed=seed, **EVERYTHING)
    assert run_checking_histories(tight, prompts) == solo
    assert tight.preemptions > 0

    again = Engine(model)
    again.add("warm", prompts["s0"], 2)
    again.run()
    again.add("s0", prompts["s0"], 14, seed=seeds["s0"], **EVERYTHING)
    assert run_checking_histories(again, prompts)["s0"] == solo["s0"]
    assert again.cached["s0"] > 0


def test_a_stop_id_past_the_vocabulary_under_min_tokens_is_no_crash(model: Any) -> None:
    engine = Engine(model)
    engine.add("r", prompt(120, 5), 4, stop_token_ids=[VOCAB + 5], min_tokens=3)
    assert len(engine.run()["r"]) == 4


# ---- the API server's side ---------------------------------------------------------------------------

MODEL = ModelConfig(max_model_len=512)


def params_of(body: dict[str, Any], kind: type[ChatCompletionRequest | CompletionRequest]) -> SamplingParams:
    req = decode_body(msgspec.json.encode(body), kind)
    output_options(req, MODEL, RequestConfig())
    return sampling_params(req, MODEL, 10)


def test_the_parameters_reach_the_engine_as_sent() -> None:
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "repetition_penalty": 1.1,
        "min_p": 1,
        "logit_bias": {"5": 100, "6": -100, "7": 0},
        "allowed_token_ids": [1, 2, MODEL.vocab_size - 1],
    }
    params = params_of(body, CompletionRequest)
    assert (params.presence_penalty, params.frequency_penalty) == (-2.0, 2.0)
    assert (params.repetition_penalty, params.min_p) == (1.1, 1.0)
    assert params.logit_bias == {5: 100.0, 6: -100.0}  # a bias of 0 is no bias
    assert params.allowed_token_ids == [1, 2, MODEL.vocab_size - 1]
    chat = {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"9": 0}, "min_p": 0}
    neutral = params_of(chat, ChatCompletionRequest)
    assert neutral == SamplingParams(max_tokens=neutral.max_tokens, temperature=1.0)
    assert Sampler(CPU, V).processors(neutral, 1) is None
    limits = {
        "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES)},
        "allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS)),
    }
    assert params_of({**body, **limits}, CompletionRequest).allowed_token_ids is not None


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(None)


def test_bad_words_are_tokenized_as_vllm_does(tokenizer: Any) -> None:
    def enc(text: str) -> list[int]:
        ids_: list[int] = tokenizer.encode(text, add_special_tokens=False)
        return ids_

    vocab = tokenizer.vocab_size
    words = bad_words_token_ids(["hello", " New York", "hello"], tokenizer, vocab)
    # As written (leading spaces stripped) and with a leading space when that is another word of as
    # many tokens; a repeated word once.
    assert words == [enc("hello"), enc(" hello"), enc("New York"), enc(" New York")]
    assert enc("hello") != enc(" hello") and len(enc(" New York")) == 2


@pytest.mark.parametrize(
    "words",
    [
        [f"w{i} x{i} y{i} z{i}" for i in range(MAX_BAD_WORDS // 2 + 1)],  # too many sequences
        ["word " * (MAX_BAD_WORDS_TOKENS // 2 + 1)],  # too many tokens
    ],
    ids=["sequences", "tokens"],
)
def test_bad_words_past_the_caps_are_a_400(tokenizer: Any, words: list[str]) -> None:
    with pytest.raises(ApiError) as info:
        bad_words_token_ids(words, tokenizer, tokenizer.vocab_size)
    assert info.value.status == 400 and info.value.param == "bad_words"


def test_bad_words_outside_the_vocabulary_are_a_400(tokenizer: Any) -> None:
    with pytest.raises(ApiError) as info:
        bad_words_token_ids(["hello"], tokenizer, 100)
    assert info.value.param == "bad_words"


def test_the_mock_engine_accepts_every_parameter() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=4, max_model_len=64)
    sampling = SamplingParams(max_tokens=3, seed=1, min_p=0.5, **ALL)  # type: ignore[arg-type]
    assert core.add(AddRequest("m", [1, 2, 3], sampling, 0.0)) is None
    tokens: list[int] = []
    for _ in range(5):
        if core.schedule() is None:
            break
        for outputs in core.update().values():
            tokens += [t for o in outputs for t in o.new_token_ids]
    assert len(tokens) == 3


# ---- the wire ----------------------------------------------------------------------------------------


def test_sampling_params_round_trip_and_old_peers_still_decode() -> None:
    full = SamplingParams(max_tokens=5, min_p=0.1, **ALL)  # type: ignore[arg-type]
    frame = msgspec.msgpack.encode(full)
    assert msgspec.msgpack.decode(frame, type=SamplingParams) == full

    class OldSamplingParams(msgspec.Struct, array_like=True):
        max_tokens: int
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = 0
        seed: int | None = None
        stop_token_ids: list[int] = msgspec.field(default_factory=list)
        ignore_eos: bool = False
        min_tokens: int = 0

    assert msgspec.msgpack.decode(frame, type=OldSamplingParams).max_tokens == 5
    old = msgspec.msgpack.encode(OldSamplingParams(7, seed=3))
    assert msgspec.msgpack.decode(old, type=SamplingParams) == SamplingParams(7, seed=3)


def test_worst_case_step_with_every_list_at_its_cap_fits_the_slot() -> None:
    sampling = SamplingParams(
        max_tokens=WORST[2],
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        seed=2**62,
        stop_token_ids=[BIG] * MAX_STOP_TOKEN_IDS,
        min_tokens=BIG,
        presence_penalty=-1.123456789,
        frequency_penalty=1.987654321,
        repetition_penalty=1.000001,
        min_p=0.123456789,
        logit_bias={BIG - i: -99.123456789 for i in range(MAX_LOGIT_BIAS_ENTRIES)},
        allowed_token_ids=[BIG] * MAX_ALLOWED_TOKEN_IDS,
        bad_words_token_ids=[[BIG] * (MAX_BAD_WORDS_TOKENS // MAX_BAD_WORDS)] * MAX_BAD_WORDS,
    )
    assert len(worst_case_step_frame(sampling)) <= step_slot_bytes(*WORST)
    # and with the most grammars a step admits, each as large as the API server lets through
    frame = worst_case_step_frame(sampling, grammars=MAX_GRAMMARS_PER_STEP)
    assert len(frame) <= step_slot_bytes(*WORST)
