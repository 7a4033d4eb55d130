"""The scheduler: exact schedules for small hand-worked cases, then preemption-invariance properties.

The fake model runner below keeps a simulated KV memory (one token id per block slot), writes each
step's tokens through the block tables it is given, and computes the next token as a function of every
previous token *read back from that memory*. So a wrong block table, position, prefix hit or resume
shows up as a wrong token, not just as a wrong count.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.engine.executor import ReferenceExecutor
from trioserve.engine.executor import next_token as reference_next_token
from trioserve.engine.scheduler import (
    NewRequestData,
    RunningRequestData,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from trioserve.protocol.messages import (
    MAX_GRAMMARS_PER_STEP,
    AddRequest,
    RequestEvent,
    RequestOutput,
    SamplingParams,
)

VOCAB = 50


def next_token(seq: Sequence[int]) -> int:
    return reference_next_token(seq, VOCAB)


class FakeRunner(ReferenceExecutor):
    """The engine's reference executor (a model over a simulated paged KV cache), plus checks."""

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config.num_blocks, config.block_size, VOCAB)

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:  # type: ignore[override]
        assert all(new.request_id not in self.tables for new in out.new_requests)
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        return self.execute_now(out)


class ScriptedRunner:
    """Returns scripted tokens (one list per step) for each request, for stop-condition cases."""

    def __init__(self, script: dict[str, list[list[int]]]) -> None:
        self.script = {rid: list(steps) for rid, steps in script.items()}

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        entries: list[NewRequestData | RunningRequestData] = [*out.new_requests, *out.running_requests]
        return {e.request_id: self.script[e.request_id].pop(0) for e in entries if e.samples}


def cfg(**kw: Any) -> SchedulerConfig:
    base: dict[str, Any] = dict(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=32, block_size=4
    )
    base.update(kw)
    return SchedulerConfig(**base)


def make_add(
    rid: str,
    prompt: int | list[int],
    max_tokens: int = 4,
    *,
    priority: int = 0,
    arrival: float = 0.0,
    client: int = 0,
    eos: int | None = None,
    salt: str | None = None,
    **sp: Any,
) -> AddRequest:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return AddRequest(
        rid,
        tokens,
        SamplingParams(max_tokens, **sp),
        arrival,
        client_index=client,
        priority=priority,
        cache_salt=salt,
        eos_token_id=eos,
    )


def flat(outputs: dict[int, list[RequestOutput]]) -> dict[str, RequestOutput]:
    return {o.request_id: o for outs in outputs.values() for o in outs}


class Driver:
    """Steps a scheduler with a runner; keeps every step's schedule and each request's tokens."""

    def __init__(self, config: SchedulerConfig, runner: FakeRunner | ScriptedRunner | None = None) -> None:
        self.s = Scheduler(config)
        self.runner = runner if runner is not None else FakeRunner(config)
        self.now = 0.0
        self.schedules: list[dict[str, int]] = []
        self.outputs: list[SchedulerOutput] = []
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, RequestOutput] = {}

    def add(self, *adds: AddRequest) -> None:
        for add in adds:
            assert self.s.add_request(add, self.now) is None

    def step(self) -> dict[str, RequestOutput]:
        self.now += 1.0
        out = self.s.schedule(self.now)
        self.outputs.append(out)
        self.schedules.append(dict(out.num_scheduled_tokens))
        sampled = self.runner.execute(out)
        results = flat(self.s.update_from_output(out, sampled))
        self.s.ledger.check_invariants()
        for rid, o in results.items():
            self.tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[rid] = o
        return results

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.s.has_work:
                return
            self.step()
            assert self.outputs[-1].total_num_scheduled_tokens > 0, "a step with work scheduled nothing"
        raise AssertionError("did not finish")


def reference(add: AddRequest, max_model_len: int) -> tuple[list[int], str]:
    """What the fake model generates for a request run alone, with the engine's stop rules."""
    sp = add.sampling
    stop_ids = set(sp.stop_token_ids)
    if add.eos_token_id is not None and not sp.ignore_eos:
        stop_ids.add(add.eos_token_id)
    tokens = list(add.prompt_token_ids)
    out: list[int] = []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in stop_ids and len(out) > sp.min_tokens:
            return out, "stop"
        if len(out) >= sp.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


# ------------------------------------------------------------------------------ token scheduling


def test_chunked_prefill_splits_a_prompt_under_the_token_budget() -> None:
    d = Driver(cfg(max_num_batched_tokens=8))
    add = make_add("a", 20, max_tokens=3)
    d.add(add)
    d.run()
    assert d.schedules == [{"a": 8}, {"a": 8}, {"a": 4}, {"a": 1}, {"a": 1}]
    first, second, third, decode = d.outputs[0], d.outputs[1], d.outputs[2], d.outputs[3]
    assert first.new_requests == [
        NewRequestData(
            "a", add.prompt_token_ids[:8], 0, [0, 1], add.sampling, samples=False, num_prompt_tokens=20
        )
    ]
    assert second.running_requests == [RunningRequestData("a", add.prompt_token_ids[8:16], 8, [2, 3], False)]
    assert third.running_requests == [RunningRequestData("a", add.prompt_token_ids[16:], 16, [4], True)]
    # A decode step computes the token sampled last step.
    assert decode.running_requests == [RunningRequestData("a", [d.tokens["a"][0]], 20, [5], True)]
    assert (d.tokens["a"], d.finish["a"].finish_reason) == reference(add, 64)


def test_scheduler_output_round_trips_through_msgpack() -> None:
    # The busy loop ships SchedulerOutput to workers over the shared-memory ring as msgpack.
    d = Driver(cfg(max_num_batched_tokens=8))
    d.add(make_add("a", 6, max_tokens=3, temperature=0.5), make_add("b", 6, max_tokens=3))
    d.step()
    d.step()
    for out in d.outputs:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput) == out
    assert d.outputs[0].new_requests[0].sampling.temperature == 0.5


def test_running_requests_go_first_and_waiting_ones_take_what_is_left() -> None:
    d = Driver(cfg(max_num_batched_tokens=8))
    d.add(make_add("a", 6, max_tokens=2), make_add("b", 6, max_tokens=2))
    d.run()
    assert d.schedules == [{"a": 6, "b": 2}, {"a": 1, "b": 4}, {"b": 1}]
    assert [len(d.tokens[r]) for r in "ab"] == [2, 2]


def test_max_num_seqs_caps_running_requests() -> None:
    d = Driver(cfg(max_num_seqs=2))
    d.add(*(make_add(rid, 2, max_tokens=2) for rid in "abc"))
    d.step()
    assert (d.s.stats().num_running, d.s.stats().num_waiting) == (2, 1)
    d.run()
    assert d.schedules == [{"a": 2, "b": 2}, {"a": 1, "b": 1}, {"c": 2}, {"c": 1}]


def test_a_step_admits_at_most_max_grammars_per_step_requests_with_a_grammar() -> None:
    n = MAX_GRAMMARS_PER_STEP
    d = Driver(cfg(max_num_seqs=4 * n, max_num_batched_tokens=1024, num_blocks=16 * n))
    d.add(make_add("plain-0", 2, max_tokens=2))
    d.add(*(make_add(f"g{i}", 2, max_tokens=2, grammar="g") for i in range(n + 1)))
    d.add(make_add("plain-1", 2, max_tokens=2))
    d.step()
    # The one past the cap stops admission, as a head of line that does not fit: queue order holds.
    assert set(d.schedules[0]) == {"plain-0", *(f"g{i}" for i in range(n))}
    d.step()
    assert {f"g{n}", "plain-1"} <= set(d.schedules[1])
    d.run()


def test_prefix_hit_skips_cached_tokens_but_always_computes_one() -> None:
    d = Driver(cfg())
    shared = list(range(10))
    a = make_add("a", shared, max_tokens=1)
    b = make_add("b", [*shared[:8], 50, 51, 52], max_tokens=2)
    c = make_add("c", shared[:8], max_tokens=1)
    d.add(a)
    d.run()
    d.add(b)
    d.step()
    # b's first two blocks are a's (freed, still cached); only its 3 new tokens are computed.
    assert d.schedules[-1] == {"b": 3}
    assert d.outputs[-1].new_requests[0].num_computed_tokens == 8
    assert d.outputs[-1].new_requests[0].block_ids[:2] == [0, 1]
    assert d.tokens["b"] == reference(b, 64)[0][:1]  # the fake model read a's KV: same token as alone
    d.run()
    assert d.finish["b"].num_cached_tokens == 8
    # A prompt made of exactly two cached blocks reuses only the first: its last token must be computed.
    d.add(c)
    d.run()
    assert d.schedules[-1] == {"c": 4}
    assert d.finish["c"].num_cached_tokens == 4
    stats = d.s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11 + 8, 8 + 4)
    for add in (a, b, c):
        assert d.tokens[add.request_id] == reference(add, 64)[0]


def test_prefix_caching_off_computes_everything() -> None:
    d = Driver(cfg(enable_prefix_caching=False))
    d.add(make_add("a", 9, max_tokens=1))
    d.run()
    d.add(make_add("b", 9, max_tokens=1))
    d.run()
    assert d.schedules == [{"a": 9}, {"b": 9}]
    assert (d.s.stats().prefix_cache_queries, d.finish["b"].num_cached_tokens) == (0, 0)


@pytest.mark.parametrize(
    ("policy", "order"),
    [("fcfs", ["a", "b", "c"]), ("priority", ["c", "b", "a"])],
)
def test_admission_order_fcfs_vs_priority(policy: str, order: list[str]) -> None:
    d = Driver(cfg(max_num_seqs=1, policy=policy))
    d.add(
        make_add("a", 2, max_tokens=1, priority=5, arrival=0.0),
        make_add("b", 2, max_tokens=1, priority=0, arrival=1.0),
        make_add("c", 2, max_tokens=1, priority=0, arrival=0.5),  # same priority as b, arrived earlier
    )
    d.run()
    assert d.schedules == [{rid: 2} for rid in order]


# ------------------------------------------------------------------------------------ preemption


def test_fcfs_preempts_the_newest_request_and_resumes_it_with_its_outputs() -> None:
    # 4 blocks of 2 slots; two requests of 3 prompt tokens and 4 outputs each cannot both finish.
    d = Driver(cfg(num_blocks=4, block_size=2))
    adds = [make_add("a", 3, max_tokens=4), make_add("b", [7, 8, 9], max_tokens=4)]
    d.add(*adds)
    d.run()
    assert d.schedules == [{"a": 3, "b": 3}, {"a": 1, "b": 1}, {"a": 1}, {"a": 1}, {"b": 3}, {"b": 1}]
    assert [o.preempted_request_ids for o in d.outputs] == [[], [], ["b"], [], [], []]
    # b resumes as a new request: its first block was still cached, the rest (prompt + its 2 outputs)
    # is recomputed, and the blocks come from what a freed (LRU: a's tail first).
    resumed = d.outputs[4].new_requests[0]
    assert (resumed.num_computed_tokens, resumed.block_ids) == (2, [2, 3, 1])
    assert resumed.token_ids == [9, *d.tokens["b"][:2]]
    for add in adds:
        assert (d.tokens[add.request_id], d.finish[add.request_id].finish_reason) == reference(add, 64)
    assert d.s.stats().num_preemptions == 1


def test_preemption_event_rides_on_the_next_output() -> None:
    d = Driver(cfg(num_blocks=4, block_size=2))
    d.add(make_add("a", 3, max_tokens=4), make_add("b", [7, 8, 9], max_tokens=4))
    first = d.step()
    assert first["b"].events == [RequestEvent("queued", 0.0), RequestEvent("scheduled", 1.0)]
    for _ in range(3):
        d.step()  # b is preempted at step 3 and waits through step 4
    resumed = d.step()  # step 5
    assert resumed["b"].events == [RequestEvent("preempted", 3.0), RequestEvent("scheduled", 5.0)]


@pytest.mark.parametrize(
    ("policy", "step3", "victim"), [("fcfs", {"x": 1}, "y"), ("priority", {"y": 1}, "x")]
)
def test_preemption_victim_by_policy(policy: str, step3: dict[str, int], victim: str) -> None:
    # x (priority 1) runs first; y (priority 0, more urgent) joins; at step 3 y needs a block and the
    # pool is full. fcfs preempts the newest (y itself); priority preempts x, the least urgent, even
    # though x was already scheduled this step: x's token goes back to the budget.
    d = Driver(cfg(num_blocks=4, block_size=2, policy=policy))
    x = make_add("x", 2, max_tokens=4, priority=1, arrival=0.0)
    y = make_add("y", [5, 6, 7, 8], max_tokens=3, priority=0, arrival=1.0)
    d.add(x)
    d.step()
    d.add(y)
    d.step()
    d.step()
    assert d.schedules == [{"x": 2}, {"x": 1, "y": 4}, step3]
    assert d.outputs[2].preempted_request_ids == [victim]
    d.run()
    for add in (x, y):
        assert d.tokens[add.request_id] == reference(add, 64)[0]


def test_priority_victim_ahead_in_the_running_list_does_not_skip_the_rest() -> None:
    # Running order [c, a, b] with c the least urgent. At step 3 c takes the last block, then a needs
    # one: c is preempted (its scheduled token given back) and both a and b still run this step.
    d = Driver(cfg(num_blocks=4, block_size=2, policy="priority"))
    c = make_add("c", [20], max_tokens=3, priority=2, arrival=0.0)
    a = make_add("a", [10, 11], max_tokens=3, priority=0, arrival=1.0)
    b = make_add("b", [12, 13], max_tokens=4, priority=1, arrival=2.0)
    d.add(c)
    d.step()
    d.add(a, b)
    d.run()
    assert d.schedules == [
        {"c": 1},
        {"c": 1, "a": 2, "b": 2},
        {"a": 1, "b": 1},
        {"a": 1, "b": 1},
        {"b": 1},
        {"c": 3},
    ]
    assert d.outputs[2].preempted_request_ids == ["c"]
    for add in (a, b, c):
        assert d.tokens[add.request_id] == reference(add, 64)[0]


def test_a_step_that_preempts_admits_no_one() -> None:
    # At step 3, a (least urgent) preempts itself and frees two blocks; c would fit, but waits a step.
    d = Driver(cfg(num_blocks=4, block_size=2, policy="priority"))
    a = make_add("a", [1, 2, 3], max_tokens=3, priority=1, arrival=0.0)
    b = make_add("b", [4, 5, 6], max_tokens=3, priority=0, arrival=1.0)
    c = make_add("c", [7], max_tokens=3, priority=0, arrival=2.0)
    d.add(a)
    d.step()
    d.add(b, c)
    d.run()
    assert d.schedules == [{"a": 3}, {"a": 1, "b": 3}, {"b": 1}, {"b": 1, "c": 1}, {"c": 1, "a": 5}, {"c": 1}]
    assert d.outputs[2].preempted_request_ids == ["a"]


def test_a_request_that_can_never_fit_is_rejected_at_add_time() -> None:
    s = Scheduler(cfg(num_blocks=2, block_size=4, max_model_len=64))
    # 5 + 4 tokens: the last is never computed, so 8 slots = 2 blocks: fits exactly.
    assert s.add_request(make_add("fits", 5, max_tokens=4), 0.0) is None
    rejected = s.add_request(make_add("big", 5, max_tokens=5), 0.0)
    assert rejected is not None
    assert (rejected.request_id, rejected.finish_reason, rejected.new_token_ids) == ("big", "error", [])
    assert rejected.error is not None and "9 tokens" in rejected.error and "only 2" in rejected.error
    assert "big" not in s.requests
    d = Driver(cfg(num_blocks=2, block_size=4))
    d.s = s
    d.run()
    assert len(d.tokens["fits"]) == 4


def test_max_model_len_bounds_the_fit_check_and_other_rejections() -> None:
    s = Scheduler(cfg(num_blocks=2, block_size=4, max_model_len=9))
    assert s.add_request(make_add("capped", 5, max_tokens=100), 0.0) is None  # at most 9 tokens
    errors = {
        rid: s.add_request(add, 0.0)
        for rid, add in [
            ("empty", make_add("empty", [])),
            ("long", make_add("long", 9)),
            ("zero", make_add("zero", 2, max_tokens=0)),
            ("capped", make_add("capped", 2)),  # duplicate id
        ]
    }
    assert all(o is not None and o.finish_reason == "error" and o.error for o in errors.values())
    assert list(s.requests) == ["capped"]


# ------------------------------------------------------------------------------- stop conditions


def scripted(script: dict[str, list[list[int]]], *adds: AddRequest, max_model_len: int = 64) -> Driver:
    d = Driver(cfg(max_model_len=max_model_len), ScriptedRunner(script))
    d.add(*adds)
    d.run()
    return d


def test_stop_token_ids_stop_and_are_reported() -> None:
    d = scripted({"a": [[5], [9], [7]]}, make_add("a", 2, max_tokens=10, stop_token_ids=[9]))
    assert d.tokens["a"] == [5, 9]
    assert (d.finish["a"].finish_reason, d.finish["a"].stop_token_id) == ("stop", 9)


def test_eos_stops_unless_ignored_but_stop_token_ids_always_stop() -> None:
    d = scripted(
        {"eos": [[3], [9]], "ignored": [[9], [9], [9]], "both": [[9], [4]]},
        make_add("eos", 2, max_tokens=10, eos=9),
        make_add("ignored", 2, max_tokens=3, eos=9, ignore_eos=True),
        make_add("both", 2, max_tokens=10, eos=9, ignore_eos=True, stop_token_ids=[4]),
    )
    assert (d.tokens["eos"], d.finish["eos"].finish_reason) == ([3, 9], "stop")
    assert (d.tokens["ignored"], d.finish["ignored"].finish_reason) == ([9, 9, 9], "length")
    assert (d.tokens["both"], d.finish["both"].stop_token_id) == ([9, 4], 4)


def test_min_tokens_defers_stops() -> None:
    d = scripted(
        {"a": [[9], [9], [9], [9]]}, make_add("a", 2, max_tokens=10, stop_token_ids=[9], min_tokens=2)
    )
    assert (d.tokens["a"], d.finish["a"].finish_reason) == ([9, 9, 9], "stop")


def test_max_tokens_and_max_model_len_end_with_length() -> None:
    d = scripted(
        {"a": [[1]] * 3, "b": [[1]] * 9},
        make_add("a", 2, max_tokens=3),
        make_add("b", 6, max_tokens=100),
        max_model_len=8,
    )
    assert (d.tokens["a"], d.finish["a"].finish_reason) == ([1, 1, 1], "length")
    assert (d.tokens["b"], d.finish["b"].finish_reason) == ([1, 1], "length")


def test_tokens_after_a_stop_in_one_step_are_dropped() -> None:
    d = scripted({"a": [[5, 9, 7]]}, make_add("a", 2, max_tokens=10, stop_token_ids=[9]))
    assert (d.tokens["a"], d.finish["a"].finish_reason) == ([5, 9], "stop")


# -------------------------------------------------------------------------- aborts, outputs, stats


def test_abort_frees_blocks_and_forgets_requests() -> None:
    d = Driver(cfg(max_num_seqs=1))
    d.add(make_add("a", 6, max_tokens=10), make_add("b", 6, max_tokens=10))
    d.step()
    assert d.s.ledger.num_used_blocks == 2
    d.s.abort(["a", "b", "unknown"])
    assert (d.s.has_work, d.s.ledger.num_used_blocks, d.s.requests) == (False, 0, {})
    out = d.s.schedule(9.0)
    # Only a had reached the runner; b never ran.
    assert (out.finished_request_ids, out.num_scheduled_tokens) == (["a"], {})
    d.s.ledger.check_invariants()


def test_a_request_aborted_while_its_step_runs_gets_no_output() -> None:
    s = Scheduler(cfg())
    s.add_request(make_add("a", 3), 0.0)
    s.add_request(make_add("b", 3), 0.0)
    out = s.schedule(1.0)
    s.abort(["a"])
    outputs = flat(s.update_from_output(out, {"a": [1], "b": [2]}))
    assert list(outputs) == ["b"]
    s.ledger.check_invariants()


def test_outputs_are_grouped_by_client_index() -> None:
    d = Driver(cfg())
    d.add(make_add("a", 2, max_tokens=1, client=0), make_add("b", 2, max_tokens=1, client=1))
    d.s.add_request(make_add("c", 2, max_tokens=1, client=1), 0.0)
    out = d.s.schedule(1.0)
    per_client = d.s.update_from_output(out, d.runner.execute(out))
    assert {c: [o.request_id for o in outs] for c, outs in per_client.items()} == {0: ["a"], 1: ["b", "c"]}


def test_stats_report_queues_usage_and_preemptions() -> None:
    d = Driver(cfg(max_num_seqs=1, num_blocks=10, block_size=2))
    d.add(make_add("a", 4, max_tokens=3), make_add("b", 2, max_tokens=3))
    assert d.s.stats().num_waiting == 2
    d.step()
    stats = d.s.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_usage, stats.num_preemptions) == (1, 1, 0.2, 0)


# --------------------------------------------------------------------- preemption invariance


def run_workload(config: SchedulerConfig, arrivals: Iterable[tuple[int, AddRequest]]) -> tuple[Driver, int]:
    by_step: dict[int, list[AddRequest]] = {}
    for step, add in arrivals:
        by_step.setdefault(step, []).append(add)
    d = Driver(config)
    last_arrival = max(by_step, default=0)
    for step in range(10_000):
        for add in by_step.get(step, []):
            assert d.s.add_request(add, d.now) is None
        if step > last_arrival and not d.s.has_work:
            return d, step
        if d.s.has_work:
            d.step()
            assert d.outputs[-1].total_num_scheduled_tokens > 0
    raise AssertionError("the workload did not finish")


def min_blocks(adds: Sequence[AddRequest], block_size: int, max_model_len: int) -> int:
    """The smallest pool every one of these requests fits in alone."""
    worst = max(min(len(a.prompt_token_ids) + a.sampling.max_tokens, max_model_len) - 1 for a in adds)
    return -(-worst // block_size)


def check_same_outputs(
    adds: list[tuple[int, AddRequest]], block_size: int, max_model_len: int, extra_blocks: int, **kw: Any
) -> int:
    """Run with a big pool and with the tightest one; both must equal the reference. Returns preemptions."""
    tiny_blocks = min_blocks([a for _, a in adds], block_size, max_model_len) + extra_blocks
    results = []
    preemptions = 0
    for num_blocks in (1000, tiny_blocks):
        config = cfg(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len, **kw)
        d, _ = run_workload(config, adds)
        results.append((d.tokens, {rid: o.finish_reason for rid, o in d.finish.items()}))
        preemptions = d.s.stats().num_preemptions
        assert d.s.ledger.num_used_blocks == 0
    expected = {a.request_id: reference(a, max_model_len) for _, a in adds}
    expected_tokens = {rid: toks for rid, (toks, _) in expected.items()}
    expected_reasons = {rid: reason for rid, (_, reason) in expected.items()}
    for tokens, reasons in results:
        assert tokens == expected_tokens
        assert reasons == expected_reasons
    return preemptions


request_strategy = st.builds(
    lambda prompt, max_tokens, min_tokens, stop, eos, priority, arrival: (
        arrival,
        make_add(
            "",  # numbered by the test
            prompt,
            max_tokens,
            priority=priority,
            arrival=float(arrival),
            eos=eos,
            min_tokens=min_tokens,
            stop_token_ids=stop,
        ),
    ),
    prompt=st.lists(st.integers(0, 2), min_size=1, max_size=12),  # tiny vocabulary: shared prefixes
    max_tokens=st.integers(1, 10),
    min_tokens=st.integers(0, 2),
    stop=st.lists(st.integers(0, VOCAB - 1), max_size=2),
    eos=st.none() | st.integers(0, VOCAB - 1),
    priority=st.integers(0, 2),
    arrival=st.integers(0, 4),
)


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_seqs=st.integers(1, 4),
    max_num_batched_tokens=st.integers(1, 16),
    policy=st.sampled_from(["fcfs", "priority"]),
    enable_prefix_caching=st.booleans(),
    extra_blocks=st.integers(0, 2),
)
def test_preemption_never_changes_outputs(
    requests: list[tuple[int, AddRequest]],
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    policy: str,
    enable_prefix_caching: bool,
    extra_blocks: int,
) -> None:
    adds = []
    for i, (arrival, add) in enumerate(requests):
        add.request_id = f"r{i}"
        adds.append((arrival, add))
    check_same_outputs(
        adds,
        block_size,
        24,
        extra_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
        enable_prefix_caching=enable_prefix_caching,
    )


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_busy_workload_on_a_tiny_pool_preempts_and_still_matches(policy: str) -> None:
    rng = random.Random(7)
    adds = [
        (
            rng.randrange(10),
            make_add(
                f"r{i}",
                [rng.randrange(3) for _ in range(rng.randrange(1, 20))],
                rng.randrange(1, 16),
                priority=rng.randrange(3),
                arrival=float(i),
            ),
        )
        for i in range(30)
    ]
    preemptions = check_same_outputs(adds, 2, 48, 2, max_num_seqs=8, max_num_batched_tokens=24, policy=policy)
    assert preemptions > 0
