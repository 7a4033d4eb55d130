"""What runs the model behind the scheduler's engine core (``engine/scheduler_core.py``), and a
deterministic reference implementation.

The core only needs ``execute``: compute one ``SchedulerOutput`` and return the sampled token ids of
the requests whose chunk ``samples`` (a dict), or a ``StepResult`` carrying them with the logprobs of
the requests that ask (the worker's answer, as it comes off the result ring). The reference executor
computes no logprobs: it returns the dict. ``engine/worker_executor.py`` drives worker processes over
shared memory; ``ReferenceExecutor`` is an in-process stand-in with exact, checkable
behaviour: it keeps a simulated paged KV cache (token ids in block slots) addressed by the block tables
the scheduler hands out, and its "model" picks the next token as a hash of the whole sequence it reads
back through those tables. A wrong block table, a lost prefix-cache block or a bad resume after
preemption therefore changes the tokens, which is what the tests check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from trioserve.protocol.step import SchedulerOutput
from trioserve.protocol.worker_messages import StepResult


class ExecutorFailed(Exception):
    """The model can no longer run: every request the engine holds is lost."""


class Executor(Protocol):
    # Set once the executor can no longer run steps (e.g. a worker died while the engine was idle);
    # the executor then calls ``on_failure``, which the engine core sets to wake its busy loop.
    failure: ExecutorFailed | None
    on_failure: Callable[[], None]

    async def execute(self, step: SchedulerOutput) -> StepResult | dict[str, list[int]]: ...


def next_token(sequence: Sequence[int], vocab_size: int) -> int:
    """The reference "model": deterministic, and sensitive to every token and its position."""
    h = 0
    for token in sequence:
        h = (h * 1_000_003 + token + 1) % (2**61 - 1)
    return h % vocab_size


class ReferenceExecutor:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int, step_time: float = 0.0) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.step_time = step_time  # seconds a forward "takes" (0: none)
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.tables: dict[str, list[int]] = {}
        self.failure: ExecutorFailed | None = None  # never: it runs in-process
        self.on_failure: Callable[[], None] = lambda: None

    async def execute(self, step: SchedulerOutput) -> dict[str, list[int]]:
        if self.step_time:
            await trio.sleep(self.step_time)
        else:
            await trio.lowlevel.checkpoint()
        return self.execute_now(step)

    def execute_now(self, step: SchedulerOutput) -> dict[str, list[int]]:
        for rid in (*step.finished_request_ids, *step.preempted_request_ids):
            self.tables.pop(rid, None)
        sampled: dict[str, list[int]] = {}
        for new in step.new_requests:
            self.tables[new.request_id] = list(new.block_ids)
            self._run(new.request_id, new.num_computed_tokens, new.token_ids, new.samples, sampled)
        for running in step.running_requests:
            self.tables[running.request_id].extend(running.new_block_ids)
            self._run(
                running.request_id, running.num_computed_tokens, running.token_ids, running.samples, sampled
            )
        return sampled

    def _run(
        self, rid: str, start: int, tokens: list[int], samples: bool, sampled: dict[str, list[int]]
    ) -> None:
        bs = self.block_size
        table = self.tables[rid]
        kv = self.kv
        for i, token in enumerate(tokens):
            pos = start + i
            kv[table[pos // bs]][pos % bs] = token
        if samples:
            end = start + len(tokens)
            sequence = [kv[table[p // bs]][p % bs] for p in range(end)]
            if any(t is None for t in sequence):
                raise RuntimeError(f"{rid}: reads a KV slot nothing wrote (bad block table)")
            sampled[rid] = [next_token([t for t in sequence if t is not None], self.vocab_size)]
