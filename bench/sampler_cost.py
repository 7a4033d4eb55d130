"""The worker sampler's step time at 32 requests: plain rows against rows with each logits processor on.

    .venv/bin/python bench/sampler_cost.py [--rows 32] [--vocab 49152] [--outputs 256] [--runs 200]

One "step" is what the model runner does per decode step once the logits are there: hand the step's
new token of every history-keeping row to the sampler (``Sampler.record``) and sample every row
(``Sampler.sample``). Rows decode at output ``--outputs`` after a ``--prompt``-token prompt. Points:

- ``plain greedy`` / ``plain sampled`` (temperature 1; and with every row seeded): no processor on any
  row, the baseline (the processor points sample at temperature 1, unseeded);
- one processor on every row: each of presence, frequency and repetition penalty, ``logit_bias`` (300
  entries, the cap), ``min_p``, ``bad_words`` (20 words of 1-3 tokens), ``allowed_token_ids`` (1000 ids);
- ``all`` of them on every row, and ``1 of 32 rows with all``: the cost plain rows pay for a neighbour;
- ``logprobs``: every row (and 1 of 32) asking for its token's logprob, rank and top-5
  (``SamplingParams.logprobs=5``, greedy and sampled), and the prompt logprobs of a 256-token prompt
  chunk at top-5 (``token_logprobs`` over its rows, what the runner adds to such a chunk);
- ``3 penalties``: the sampler's sparse pool (each row's distinct tokens and counts) against two
  alternatives, a dense ``[rows, vocab]`` pool of counts and prompt masks, and rebuilding each step's
  counts and masks from token lists as vLLM's sampler does (bincount over padded tensors), at
  ``--outputs`` and at 8 times that: why the state is what it is;
- ``slot-token mirror``: the runner's one scatter per step of the step's tokens into ``slot_tokens``
  (every request pays it), for a 32-token decode step and a 2048-token prefill.

Timed in thread CPU time (``time.thread_time_ns``) with one torch thread, so time the process spends
descheduled on a shared machine does not count; each point is the median of ``--runs`` steps after a
warm-up, run ``--repeat`` times, the fastest kept. The logits are restored outside the timed region.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from trioserve.protocol.messages import SamplingParams
from trioserve.worker.sampler import RequestProcessors, Sampler, SamplingRow, token_logprobs


def thread_us(fn: Callable[[], Any], before: Callable[[], Any], runs: int) -> float:
    for _ in range(5):
        before()
        fn()
    times = []
    for _ in range(runs):
        before()
        t0 = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t0)
    return statistics.median(times) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152, help="SmolLM2's (the embedded model); Qwen3: 151936")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--outputs", type=int, default=256)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows_n, vocab = args.rows, args.vocab
    g = torch.Generator().manual_seed(0)
    base = torch.randn(rows_n, vocab, generator=g) * 3
    buf = base.clone()

    def restore() -> None:
        buf.copy_(base)

    def history(seed: int, n: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = torch.randint(0, vocab, (n,), generator=gen).tolist()
        return out

    bias = {t: 1.5 for t in history(1, 300)}
    bad = [history(100 + i, 1 + i % 3) for i in range(20)]
    allowed = sorted(set(history(2, 1000)))
    settings: dict[str, dict[str, Any]] = {
        "presence_penalty": {"presence_penalty": 0.5},
        "frequency_penalty": {"frequency_penalty": 0.5},
        "repetition_penalty": {"repetition_penalty": 1.2},
        "logit_bias (300)": {"logit_bias": bias},
        "bad_words (20)": {"bad_words_token_ids": bad},
        "allowed_token_ids (1000)": {"allowed_token_ids": allowed},
    }
    everything: dict[str, Any] = {k: v for s in settings.values() for k, v in s.items()}

    def point(
        params: list[dict[str, Any]],
        temperature: float,
        min_p: float = 0.0,
        seeded: bool = False,
        runs: int = 0,
        logprobs: list[int | None] | None = None,
    ) -> float:
        sampler = Sampler(torch.device("cpu"), vocab)
        procs: list[RequestProcessors | None] = []
        for i, p in enumerate(params):
            proc = sampler.processors(SamplingParams(max_tokens=10**6, **p), args.prompt)
            if proc is not None:
                sampler.record([(proc, history(1000 + i, args.prompt + args.outputs))])
            procs.append(proc)
        rows = [
            SamplingRow(
                temperature,
                seed=i if seeded else None,
                output_index=args.outputs,
                min_p=min_p if (min_p and i < len(params)) else 0.0,
                processors=proc,
                logprobs=logprobs[i] if logprobs else None,
            )
            for i, proc in enumerate(procs)
        ]
        kept = [p for p in procs if p is not None and p.keeps_history]
        new_token = [[i % vocab] for i in range(len(kept))]

        def step() -> None:
            if kept:
                sampler.record(list(zip(kept, new_token, strict=True)))
            sampler.sample_with_logprobs(buf, rows)

        # Greedy points are cheap: more repeats, so the fastest is closer to the machine's floor.
        repeat = args.repeat * (3 if temperature == 0.0 else 1)
        return min(thread_us(step, restore, runs or args.runs) for _ in range(repeat))

    plain = [{}] * rows_n
    # Stages 1-3 do not depend on the temperature: timed on greedy rows, where the draw's noise (most
    # of a sampled step) does not drown them. min_p and the full sampled step come after.
    greedy_runs, sampled_runs = args.runs, max(20, args.runs // 5)
    point(plain, 0.0, runs=greedy_runs)  # warm-up: the first point would pay torch's first-use costs
    results: list[tuple[str, float]] = [("plain greedy", point(plain, 0.0, runs=greedy_runs))]
    for name, s in settings.items():
        results.append((f"greedy, {name}", point([s] * rows_n, 0.0, runs=greedy_runs)))
    results.append(("greedy, all of them", point([everything] * rows_n, 0.0, runs=greedy_runs)))
    results.append(
        ("greedy, 1 of 32 rows with all", point([everything] + [{}] * (rows_n - 1), 0.0, runs=greedy_runs))
    )
    top5: list[int | None] = [5] * rows_n
    one_top5: list[int | None] = [5] + [None] * (rows_n - 1)
    results += [
        ("greedy, logprobs top-5", point(plain, 0.0, runs=greedy_runs, logprobs=top5)),
        ("greedy, 1 of 32 rows with logprobs top-5", point(plain, 0.0, runs=greedy_runs, logprobs=one_top5)),
        ("sampled, plain", point(plain, 1.0, runs=sampled_runs)),
        ("sampled, logprobs top-5", point(plain, 1.0, runs=sampled_runs, logprobs=top5)),
        ("sampled, plain, every row seeded", point(plain, 1.0, seeded=True, runs=sampled_runs)),
        ("sampled, min_p", point(plain, 1.0, min_p=0.05, runs=sampled_runs)),
        ("sampled, all of them", point([everything] * rows_n, 1.0, min_p=0.05, runs=sampled_runs)),
    ]

    def rebuilt(outputs: int) -> float:
        """vLLM's way: counts and masks rebuilt from the token lists every step (penalties only)."""
        prompts = [history(3000 + i, args.prompt) for i in range(rows_n)]
        outs = [history(4000 + i, outputs) for i in range(rows_n)]
        rep = torch.full((rows_n, 1), 1.2)

        def step() -> None:
            for o in outs:
                o.append(7)  # this step's token
            out_t = torch.tensor([o[-outputs:] for o in outs])
            prompt_t = torch.tensor(prompts)
            counts = torch.zeros(rows_n, vocab + 1).scatter_add_(
                1, out_t, torch.ones_like(out_t, dtype=torch.float)
            )
            counts = counts[:, :vocab]
            seen = torch.zeros(rows_n, vocab + 1, dtype=torch.bool).scatter_(1, prompt_t, True)[:, :vocab]
            seen |= counts > 0
            penalty = torch.where(seen, rep, 1.0)
            x = torch.where(buf > 0, buf / penalty, buf * penalty)
            x -= 0.5 * counts
            x -= 0.5 * (counts > 0)
            x.argmax(dim=-1).tolist()

        return min(thread_us(step, restore, args.runs) for _ in range(args.repeat))

    def dense(outputs: int) -> float:
        """A dense pool: ``[rows, vocab]`` counts and prompt masks kept up to date on the device, each
        step's penalties found with ``nonzero`` over the gathered rows (this code's first design)."""
        counts = torch.zeros(rows_n, vocab)
        prompt = torch.zeros(rows_n, vocab, dtype=torch.bool)
        for i in range(rows_n):
            prompt[i, history(3000 + i, args.prompt)] = True
            counts[i].index_add_(0, torch.tensor(history(4000 + i, outputs)), torch.ones(outputs))
        slots = torch.arange(rows_n)
        sevens = torch.full((rows_n,), 7)

        def step() -> None:
            counts.index_put_((slots, sevens), torch.ones(rows_n), accumulate=True)  # this step's token
            c = counts[slots]
            seen = prompt[slots] | (c > 0)
            r, t = seen.nonzero(as_tuple=True)
            x = buf[r, t]
            buf[r, t] = torch.where(x > 0, x / 1.2, x * 1.2)
            r, t = c.nonzero(as_tuple=True)
            buf[r, t] -= 0.5 * c[r, t] + 0.5
            buf.argmax(dim=-1).tolist()

        return min(thread_us(step, restore, args.runs) for _ in range(args.repeat))

    def pooled_penalties(outputs: int) -> float:
        p = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
        saved = args.outputs
        args.outputs = outputs
        try:
            return point([p] * rows_n, 0.0, runs=greedy_runs)
        finally:
            args.outputs = saved

    for n in (args.outputs, 8 * args.outputs):
        results.append((f"greedy, 3 penalties, {n} outputs: the sampler", pooled_penalties(n)))
        results.append((f"greedy, 3 penalties, {n} outputs: dense pool", dense(n)))
        results.append((f"greedy, 3 penalties, {n} outputs: rebuilt from lists", rebuilt(n)))

    chunk = torch.randn(256, vocab, generator=g) * 3
    chunk_targets = history(5000, 256)
    us = min(
        thread_us(
            lambda: token_logprobs(chunk, chunk_targets, [5] * 256), lambda: None, max(10, args.runs // 10)
        )
        for _ in range(args.repeat)
    )
    results.append(("prompt logprobs top-5, 256-token chunk", us))

    mirror = torch.zeros(4096 * 16, dtype=torch.long)
    for n in (rows_n, 2048):
        blocks = torch.randint(0, 4096, (n,))
        offsets = torch.randint(0, 16, (n,))
        tokens = torch.randint(0, vocab, (n,))

        def write(
            blocks: torch.Tensor = blocks, offsets: torch.Tensor = offsets, t: torch.Tensor = tokens
        ) -> None:
            mirror[blocks * 16 + offsets] = t

        us = min(thread_us(write, lambda: None, args.runs) for _ in range(args.repeat))
        results.append((f"slot-token mirror, {n} tokens", us))

    print(f"rows {rows_n}, vocab {vocab}, prompt {args.prompt}, outputs {args.outputs}, torch threads 1")
    plain_of = {
        "greedy": results[0][1],
        "sampled": next(us for name, us in results if name == "sampled, plain"),
    }
    width = max(len(name) for name, _ in results)
    for name, us in results:
        kind = name.split(",")[0]
        extra = f"  {us - plain_of[kind]:+9.1f} µs over plain {kind}" if kind in plain_of else ""
        print(f"{name:<{width}}  {us:9.1f} µs{extra}")


if __name__ == "__main__":
    main()
