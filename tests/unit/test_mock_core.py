"""The mock engine core: exact outputs for small hand-worked cases, and its step clock's rules."""

from __future__ import annotations

import pytest

from trioserve.mock.core import MockCore, StepClock
from trioserve.protocol.messages import AddRequest, RequestOutput, SamplingParams


def add(rid: str, max_tokens: int, *, prompt: int = 3, client: int = 0, **sp: object) -> AddRequest:
    return AddRequest(rid, list(range(prompt)), SamplingParams(max_tokens, **sp), 0.0, client_index=client)  # type: ignore[arg-type]


def flat(step: dict[int, list[RequestOutput]]) -> dict[str, RequestOutput]:
    return {o.request_id: o for outs in step.values() for o in outs}


def run_step(core: MockCore) -> dict[int, list[RequestOutput]]:
    """One step as the shell runs it, minus the clock (``execute`` only waits): schedule, update."""
    if core.schedule() is None:
        return {}
    return core.update()


def test_one_token_per_running_request_per_step_until_max_tokens() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=8, max_model_len=64)
    core.add(add("a", 2))
    core.add(add("b", 3))
    steps = [flat(run_step(core)) for _ in range(3)]
    assert [sorted(s) for s in steps] == [["a", "b"], ["a", "b"], ["b"]]
    assert all(len(o.new_token_ids) == 1 for s in steps for o in s.values())
    assert [steps[1]["a"].finish_reason, steps[2]["b"].finish_reason] == ["length", "length"]
    assert not core.has_work


def test_max_num_seqs_admits_in_arrival_order() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=2, max_model_len=64)
    for rid in "abc":
        core.add(add(rid, 1))
    assert sorted(flat(run_step(core))) == ["a", "b"]
    assert (core.stats().num_waiting, core.stats().num_running) == (1, 0)  # c is admitted next step
    assert sorted(flat(run_step(core))) == ["c"]


def test_outputs_are_grouped_by_client() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=8, max_model_len=64)
    core.add(add("a", 1, client=0))
    core.add(add("b", 1, client=1))
    step = run_step(core)
    assert {c: [o.request_id for o in outs] for c, outs in step.items()} == {0: ["a"], 1: ["b"]}


def test_stop_token_ids_always_stop_eos_unless_ignored() -> None:
    # vocab_size 1: every token is 0.
    core = MockCore(vocab_size=1, max_num_seqs=8, max_model_len=64)
    core.add(add("stop-id", 5, stop_token_ids=[0], ignore_eos=True))
    eos = add("eos", 5)
    eos.eos_token_id = 0
    core.add(eos)
    ignored = add("eos-ignored", 2, ignore_eos=True)
    ignored.eos_token_id = 0
    core.add(ignored)
    first = flat(run_step(core))
    assert (first["stop-id"].finish_reason, first["stop-id"].stop_token_id) == ("stop", 0)
    assert (first["eos"].finish_reason, first["eos"].stop_token_id) == ("stop", 0)
    assert first["eos-ignored"].finish_reason is None
    assert flat(run_step(core))["eos-ignored"].finish_reason == "length"


def test_min_tokens_delays_a_stop_token() -> None:
    core = MockCore(vocab_size=1, max_num_seqs=8, max_model_len=64)
    core.add(add("a", 5, stop_token_ids=[0], min_tokens=2))
    reasons = [flat(run_step(core))["a"].finish_reason for _ in range(3)]
    assert reasons == [None, None, "stop"]


def test_seeded_requests_repeat_their_tokens() -> None:
    def tokens(seed: int) -> list[int]:
        core = MockCore(vocab_size=1000, max_num_seqs=8, max_model_len=64, seed=123)
        core.add(add("other", 4))  # another request in the batch must not change the seeded stream
        core.add(add("a", 4, seed=seed))
        return [flat(run_step(core))["a"].new_token_ids[0] for _ in range(4)]

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)


def test_abort_removes_running_and_waiting_requests() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=1, max_model_len=64)
    core.add(add("running", 10))
    core.add(add("waiting", 10))
    run_step(core)
    core.abort(["running", "waiting", "unknown"])
    assert not core.has_work
    assert run_step(core) == {}


def test_prompt_that_cannot_fit_is_rejected_and_context_bounds_output() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=8, max_model_len=8)
    rejected = core.add(add("long", 1, prompt=8))
    assert (
        rejected is not None
        and rejected.finish_reason == "error"
        and "max_model_len" in (rejected.error or "")
    )
    assert core.add(add("fits", 100, prompt=6)) is None
    reasons = [flat(run_step(core))["fits"].finish_reason for _ in range(2)]
    assert reasons == [None, "length"]  # 6 prompt + 2 output tokens = max_model_len


def test_schedule_counts_the_requests_that_get_a_token() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=2, max_model_len=64)
    assert core.schedule() is None  # nothing to do
    for rid in "abc":
        core.add(add(rid, 5))
    assert core.schedule() == 2  # max_num_seqs of the three


def test_a_request_added_during_a_step_gets_its_token_at_the_end_of_that_step() -> None:
    """Instant prefill: admission happens when the step's tokens are made, not when it starts."""
    core = MockCore(vocab_size=100, max_num_seqs=8, max_model_len=64)
    core.add(add("a", 5))
    assert core.schedule() == 1
    core.add(add("late", 5))  # arrives while the step runs (the shell awaits execute)
    assert sorted(flat(core.update())) == ["a", "late"]


def test_step_clock_keeps_its_schedule_and_restarts_when_late_or_after_rest() -> None:
    clock = StepClock(interval=0.010)
    assert clock.next_end(100.0) == pytest.approx(100.010)  # first step: starts at once
    # Back to back, a little late from our own work: no drift.
    assert clock.next_end(100.013) == pytest.approx(100.020)
    assert clock.next_end(100.020) == pytest.approx(100.030)
    # A whole interval late: starts now, later steps spaced from here (MissedTickBehavior::Delay).
    assert clock.next_end(100.045) == pytest.approx(100.055)
    assert clock.next_end(100.056) == pytest.approx(100.065)
    # After idling, a step starts when work arrives, even within an interval of the last one.
    clock.rest()
    assert clock.next_end(100.068) == pytest.approx(100.078)


def test_the_core_rests_its_clock_when_it_runs_out_of_work() -> None:
    core = MockCore(vocab_size=100, max_num_seqs=8, max_model_len=64, step_interval_us=10_000)
    clock = core._clock
    core.add(add("a", 1))
    assert core.schedule() == 1
    assert clock.next_end(5.0) == pytest.approx(5.010)
    core.update()  # "a" is done
    assert core.schedule() is None
    core.add(add("b", 1))
    assert core.schedule() == 1
    assert clock.next_end(5.013) == pytest.approx(5.023)  # not 5.020: a fresh start
