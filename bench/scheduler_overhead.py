"""Pure-Python scheduler overhead per engine step: µs of schedule() + update_from_output().

    .venv/bin/python bench/scheduler_overhead.py [--steps 200] [--block-size 16]

Points:

- ``decode N``: N requests all in steady decode (one token each per step), prefix caching on, so the
  cost includes hashing each output block as it fills and registering it in the ledger.
- ``mixed``: 256 requests decoding while new 512-token prompts keep arriving and are chunk-prefilled
  under a 2048-token budget; requests finish after random lengths, so admission, block growth, freeing
  and prefix lookups all run every step.

The "model" is a constant token per sampled request, built outside the timed region; only the two
scheduler verbs are timed, in thread CPU time (``time.thread_time_ns``) so that time the process spends
descheduled on a shared machine does not count. Each point is a median over ``--steps`` steps after a
warm-up; each point is run ``--repeat`` times from scratch and the fastest run is reported (noise on a
shared machine only ever adds time).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from trioserve.engine.scheduler import Scheduler, SchedulerConfig
from trioserve.protocol.messages import AddRequest, SamplingParams
from trioserve.protocol.step import SchedulerOutput


@dataclass(slots=True)
class Point:
    name: str
    running: float  # mean over the timed steps
    tokens: float
    schedule_us: float
    update_us: float

    @property
    def total_us(self) -> float:
        return self.schedule_us + self.update_us


def sample_all(out: SchedulerOutput) -> dict[str, list[int]]:
    sampled = {r.request_id: [7] for r in out.new_requests if r.samples}
    sampled.update((r.request_id, [7]) for r in out.running_requests if r.samples)
    return sampled


def measure(
    name: str, s: Scheduler, steps: int, warmup: int, feed: Callable[[Scheduler, float], None] | None = None
) -> Point:
    sched_ns: list[int] = []
    update_ns: list[int] = []
    running: list[int] = []
    tokens: list[int] = []
    now = 0.0
    for i in range(warmup + steps):
        if feed is not None:
            feed(s, now)
        now += 0.01
        t0 = time.thread_time_ns()
        out = s.schedule(now)
        t1 = time.thread_time_ns()
        sampled = sample_all(out)
        t2 = time.thread_time_ns()
        s.update_from_output(out, sampled)
        t3 = time.thread_time_ns()
        if i >= warmup:
            sched_ns.append(t1 - t0)
            update_ns.append(t3 - t2)
            running.append(len(out.num_scheduled_tokens))
            tokens.append(out.total_num_scheduled_tokens)
    return Point(
        name,
        statistics.fmean(running),
        statistics.fmean(tokens),
        statistics.median(sched_ns) / 1000,
        statistics.median(update_ns) / 1000,
    )


def decode_point(n: int, steps: int, block_size: int) -> Point:
    rng = random.Random(0)
    prompt_len = 128
    s = Scheduler(
        SchedulerConfig(
            max_num_seqs=n,
            max_num_batched_tokens=max(8192, n),
            max_model_len=8192,
            num_blocks=n * (prompt_len + steps * 2 + 64) // block_size + 16,
            block_size=block_size,
        )
    )
    for i in range(n):
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        s.add_request(AddRequest(f"r{i}", prompt, SamplingParams(10**6, ignore_eos=True), 0.0), 0.0)
    # Warm-up prefills everyone (n * 128 tokens under an 8192 budget) and settles into decode.
    warmup = n * prompt_len // max(8192, n) + 5
    point = measure(f"decode {n}", s, steps, warmup)
    assert s.stats().num_running == n
    return point


def mixed_point(steps: int, block_size: int) -> Point:
    rng = random.Random(1)
    s = Scheduler(
        SchedulerConfig(
            max_num_seqs=320,
            max_num_batched_tokens=2048,
            max_model_len=8192,
            num_blocks=(320 * 1024) // block_size,
            block_size=block_size,
        )
    )
    counter = 0
    system_prompt = [rng.randrange(32000) for _ in range(256)]  # shared: prefix hits on half of each prompt

    def add(sched: Scheduler, now: float) -> None:
        nonlocal counter
        prompt = system_prompt + [rng.randrange(32000) for _ in range(256)]
        max_tokens = rng.randrange(64, 512)
        add_req = AddRequest(f"m{counter}", prompt, SamplingParams(max_tokens, ignore_eos=True), now)
        sched.add_request(add_req, now)
        counter += 1

    for _ in range(256):
        add(s, 0.0)

    def feed(sched: Scheduler, now: float) -> None:
        # Keep about 256 requests in the system: replace the ones that finished.
        while len(sched.requests) < 256 + 8:
            add(sched, now)

    return measure("mixed (256 + 512-token prefills)", s, steps, warmup=300, feed=feed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    runs: list[Callable[[], Point]] = [
        lambda: decode_point(256, args.steps, args.block_size),
        lambda: decode_point(1024, args.steps, args.block_size),
        lambda: mixed_point(args.steps, args.block_size),
    ]
    points = [min((run() for _ in range(args.repeat)), key=lambda p: p.total_us) for run in runs]
    print(
        f"block_size {args.block_size}, prefix caching on, thread CPU time, median over {args.steps} steps, "
        f"best of {args.repeat} runs\n"
    )
    print("| point | req/step | tokens/step | schedule() µs | update() µs | total µs/step | µs/request |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p in points:
        print(
            f"| {p.name} | {p.running:.0f} | {p.tokens:.0f} | {p.schedule_us:.0f} | {p.update_us:.0f} "
            f"| {p.total_us:.0f} | {p.total_us / p.running:.2f} |"
        )


if __name__ == "__main__":
    main()
