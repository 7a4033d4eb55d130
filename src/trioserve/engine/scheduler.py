"""The scheduler: which tokens of which requests the next forward pass computes (design §7).

Pure: imports no trio, zmq or torch and reads no clock; the engine core (``engine/scheduler_core.py``)
drives it with two verbs and passes the time in:

    output = scheduler.schedule(now)                     # -> SchedulerOutput, for the model runner
    sampled = <run the model on output>                  # {request_id: [token ids sampled this step]}
    per_client = scheduler.update_from_output(output, sampled)  # -> {client_index: [RequestOutput]}

It schedules tokens, not phases. Every request has ``num_computed_tokens``; a step is
``{request_id: num_new_tokens}``. A new prompt is split into chunks under ``max_num_batched_tokens``
(chunked prefill), a prefix-cache hit simply starts ``num_computed_tokens`` past the cached blocks, and a
decode step is the case ``num_new_tokens == 1``. One loop covers all three.

Each step:

1. Running requests first, in admission order, each getting ``min(num_tokens - num_computed_tokens,
   budget)`` tokens. When the ledger cannot grow a request's table, the scheduler preempts by
   recompute: the victim (fcfs: the newest running request; priority: the one with the largest
   ``(priority, arrival_time)``, i.e. least urgent) frees its blocks, resets ``num_computed_tokens``,
   keeps its outputs and goes back to the waiting queue at its old place. If the victim was already
   scheduled this step, its tokens are given back to the budget. If the victim is the request itself,
   it is not scheduled.
2. Then, unless step 1 preempted anything (the pool is tight; admitting more would only thrash),
   waiting requests in queue order while fewer than ``max_num_seqs`` run and budget is left: look up the
   prefix cache, allocate blocks for the first chunk, move to running. The first request that does not
   fit stops admission for this step, so a big request at the head is not overtaken forever; so does
   a request with a grammar once ``MAX_GRAMMARS_PER_STEP`` of them were admitted in this step (the
   step's ring slot is sized for that many grammars).

Logprobs: the step's sampled-token logprobs ride on the outputs as they come (``update_from_output``);
prompt logprobs are gathered on the request chunk by chunk and go out with its first output, once (a
request asking for them skips the prefix cache until then, and a request that has sent them is resumed
after a preemption with ``prompt_logprobs`` off, so the worker does not compute them again).

A request that could never fit the ledger alone (more blocks than exist, for its longest possible
sequence) is rejected when it is added, with an error output, instead of starving the queue behind it.

The step structs and their block-table format live in ``protocol/step.py``: they cross to the worker
processes as they are.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import msgspec

from trioserve.engine.kv_ledger import KVLedger
from trioserve.engine.request import Request, RequestStatus
from trioserve.protocol.messages import (
    MAX_GRAMMARS_PER_STEP,
    AddRequest,
    EngineStats,
    RequestOutput,
    TokenLogprobs,
)
from trioserve.protocol.step import NewRequestData, RunningRequestData, SchedulerOutput
from trioserve.protocol.worker_messages import MAX_ENGINE_LOGPROBS

SchedulingPolicy = Literal["fcfs", "priority"]

_RUNNING = RequestStatus.RUNNING


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int  # most requests running (holding blocks) at once
    max_num_batched_tokens: int  # most tokens computed in one step, over all requests
    max_model_len: int  # most tokens (prompt + output) per request
    num_blocks: int  # KV-cache blocks in the pool
    block_size: int  # token slots per block
    policy: SchedulingPolicy = "fcfs"
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}")


# --------------------------------------------------------------------------------------------------
# The waiting queue.
# --------------------------------------------------------------------------------------------------


class _WaitingQueue:
    """A heap ordered by each request's fixed sort key.

    fcfs: ``(seq,)`` (add order); priority: ``(priority, arrival_time, seq)``. The key never changes,
    so a preempted request pushed back lands exactly at its old place; under fcfs, with admission in
    queue order, that is the front.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, ...], Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, key: tuple[float, ...], request: Request) -> None:
        heapq.heappush(self._heap, (key, request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request_ids: set[str]) -> None:
        # Rare (aborts of requests that never ran): a rebuild is fine.
        self._heap = [item for item in self._heap if item[1].request_id not in request_ids]
        heapq.heapify(self._heap)


# --------------------------------------------------------------------------------------------------
# The scheduler.
# --------------------------------------------------------------------------------------------------


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.ledger = KVLedger(config.num_blocks, config.block_size)
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        self.running: list[Request] = []  # admission order
        self.waiting = _WaitingQueue()
        self._keys: dict[str, tuple[float, ...]] = {}
        self._seq = 0
        self._step = 0
        self._num_preemptions = 0
        # Finished or aborted since the last schedule(), for SchedulerOutput.finished_request_ids.
        self._finished_ids: list[str] = []
        # Block hashes are only needed (and only computed) with prefix caching on.
        self._hash_block_size = config.block_size if config.enable_prefix_caching else 0

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ------------------------------------------------------------------------------- adding, aborts

    def add_request(self, add: AddRequest, now: float) -> RequestOutput | None:
        """Queue a request; or return the error output that rejects it (nothing is kept then)."""
        error = self._admission_error(add)
        if error is not None:
            return RequestOutput(add.request_id, [], finish_reason="error", error=error)
        request = Request.from_add(add, block_size=self._hash_block_size, now=now)
        self.requests[request.request_id] = request
        key: tuple[float, ...] = (
            (request.priority, request.arrival_time, self._seq)
            if self.config.policy == "priority"
            else (self._seq,)
        )
        self._seq += 1
        self._keys[request.request_id] = key
        self.waiting.push(key, request)
        return None

    def _admission_error(self, add: AddRequest) -> str | None:
        cfg = self.config
        prompt_len = len(add.prompt_token_ids)
        if add.request_id in self.requests:
            return f"request id {add.request_id!r} is already in use on this engine"
        if prompt_len == 0:
            return "the prompt is empty"
        if prompt_len >= cfg.max_model_len:
            return (
                f"prompt of {prompt_len} tokens leaves no room for output "
                f"within max_model_len {cfg.max_model_len}"
            )
        if add.sampling.max_tokens < 1:
            return f"max_tokens must be at least 1, got {add.sampling.max_tokens}"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(add.sampling, name)
            if k is not None and not 0 <= k <= MAX_ENGINE_LOGPROBS:
                return f"{name} must be between 0 and {MAX_ENGINE_LOGPROBS}, got {k}"
        # The last token of a finished request is never computed, so its KV needs final_len - 1 slots.
        final_len = min(prompt_len + add.sampling.max_tokens, cfg.max_model_len)
        blocks = self.ledger.blocks_for(final_len - 1)
        if blocks > cfg.num_blocks:
            return (
                f"request needs up to {final_len - 1} tokens of KV cache "
                f"({blocks} blocks of {cfg.block_size}) but the engine has only {cfg.num_blocks}; "
                "lower max_tokens or shorten the prompt"
            )
        return None

    def abort(self, request_ids: Iterable[str]) -> None:
        """Free the requests' blocks and forget them; unknown (e.g. already finished) ids are ignored."""
        aborted_waiting: set[str] = set()
        aborted_running = False
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            del self._keys[rid]
            if request.status is RequestStatus.RUNNING:
                aborted_running = True
                self._finished_ids.append(rid)
            else:
                aborted_waiting.add(rid)
            request.status = RequestStatus.FINISHED_ABORTED
            self.ledger.free(rid)
        if aborted_running:
            self.running = [r for r in self.running if r.status is _RUNNING]
        if aborted_waiting:
            self.waiting.remove(aborted_waiting)

    # ------------------------------------------------------------------------------------- schedule

    def schedule(self, now: float) -> SchedulerOutput:
        """Choose this step's tokens. ``now`` stamps the "scheduled" and "preempted" events."""
        cfg = self.config
        ledger = self.ledger
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        running_data: list[RunningRequestData] = []
        preempted: list[Request] = []
        tables = ledger.block_tables
        block_size = cfg.block_size

        # 1. Running requests, in admission order.
        running = self.running
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            rid = request.request_id
            start = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            num_new = min(num_tokens - start, budget)
            target = start + num_new
            # Most steps need no new block (decode inside a block): skip the ledger call then.
            new_blocks = [] if target <= len(tables[rid]) * block_size else ledger.allocate(rid, target)
            while new_blocks is None:
                victim_index = self._victim_index(running)
                victim = running.pop(victim_index)
                undone = num_scheduled.pop(victim.request_id, 0)
                if undone:
                    budget += undone
                    running_data = [r for r in running_data if r.request_id != victim.request_id]
                self._preempt(victim, now)
                preempted.append(victim)
                if victim is request:
                    break
                if victim_index < index:
                    index -= 1
                new_blocks = ledger.allocate(rid, target)
            if new_blocks is None:
                continue  # the request preempted itself; running[index] is now the next one
            running_data.append(
                RunningRequestData(
                    rid, request.all_token_ids[start:target], start, new_blocks, target == num_tokens
                )
            )
            num_scheduled[rid] = num_new
            budget -= num_new
            index += 1

        # 2. Waiting requests, unless this step had to preempt.
        new_data: list[NewRequestData] = []
        if not preempted:
            budget = self._admit(budget, num_scheduled, new_data, now)

        finished_ids, self._finished_ids = self._finished_ids, []
        self._step += 1
        return SchedulerOutput(
            step=self._step,
            new_requests=new_data,
            running_requests=running_data,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            preempted_request_ids=[r.request_id for r in preempted],
            finished_request_ids=finished_ids,
        )

    def _admit(
        self, budget: int, num_scheduled: dict[str, int], new_data: list[NewRequestData], now: float
    ) -> int:
        cfg = self.config
        ledger = self.ledger
        waiting = self.waiting
        grammars = 0  # new requests with a grammar this step (the step's ring slot holds so many)
        while len(waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = waiting.peek()
            if request.sampling.grammar is not None:
                if grammars == MAX_GRAMMARS_PER_STEP:
                    break  # as a head of line that does not fit: the next step takes it
                grammars += 1
            rid = request.request_id
            num_tokens = request.num_tokens
            cached: list[int] = []
            lookup = cfg.enable_prefix_caching and not request.wants_prompt_logprobs
            if lookup:
                cached = ledger.lookup_prefix(request.block_hashes, num_tokens)
            num_computed = len(cached) * cfg.block_size
            num_new = min(num_tokens - num_computed, budget)
            target = num_computed + num_new
            new_blocks = ledger.allocate(rid, target, cached)
            if new_blocks is None:
                break  # head of line does not fit: admit no one past it this step
            waiting.pop()
            if request.num_cached_tokens < 0:  # first admission (a resume is not a new query)
                request.num_cached_tokens = num_computed
                if lookup:
                    ledger.record_prefix_lookup(num_tokens, num_computed)
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            request.record_event("scheduled", now)
            self.running.append(request)
            sampling = request.sampling
            if request.sent_prompt_logprobs:  # a resume: the worker need not compute them again
                sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
            new_data.append(
                NewRequestData(
                    rid,
                    request.all_token_ids[num_computed:target],
                    num_computed,
                    list(ledger.block_table(rid)),
                    sampling,
                    target == num_tokens,
                    len(request.prompt_token_ids),
                    request.eos_token_id,
                )
            )
            num_scheduled[rid] = num_new
            budget -= num_new
        return budget

    def _victim_index(self, running: list[Request]) -> int:
        """Whom to preempt: fcfs, the newest admitted; priority, the least urgent (latest on ties)."""
        if self.config.policy == "fcfs":
            return len(running) - 1
        keys = self._keys
        return max(range(len(running)), key=lambda i: keys[running[i].request_id])

    def _preempt(self, request: Request, now: float) -> None:
        self.ledger.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.restart_prompt_logprobs()
        request.num_preemptions += 1
        request.record_event("preempted", now)
        self._num_preemptions += 1
        self.waiting.push(self._keys[request.request_id], request)

    # ---------------------------------------------------------------------------- update_from_output

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[str, list[int]],
        logprobs: dict[str, list[TokenLogprobs]] | None = None,
        prompt_logprobs: dict[str, list[TokenLogprobs]] | None = None,
    ) -> dict[int, list[RequestOutput]]:
        """Advance the scheduled requests by the step's results; return outputs per client index.

        ``sampled`` needs an entry for every scheduled request whose chunk ``samples`` (other entries
        are ignored: a partial prefill chunk's sample is meaningless); its lists become the outputs'
        ``new_token_ids``, so the caller must not reuse them. Requests aborted while the step ran are
        skipped. ``logprobs``: per request, one entry per sampled token (cut with the tokens at a
        stop); ``prompt_logprobs``: the prompt tokens' logprobs this step's chunk made known, in order,
        gathered on the request until its first output carries them all.
        """
        cfg = self.config
        ledger = self.ledger
        requests = self.requests
        block_size = cfg.block_size if cfg.enable_prefix_caching else 0
        max_model_len = cfg.max_model_len
        outputs: dict[int, list[RequestOutput]] = {}
        any_finished = False
        for rid, num_new in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None or request.status is not _RUNNING:
                continue  # aborted after schedule()
            old = request.num_computed_tokens
            computed = request.num_computed_tokens = old + num_new
            # Blocks that just filled with computed tokens become findable by hash.
            if block_size and computed // block_size != old // block_size:
                ledger.cache_blocks(rid, request.block_hashes, computed)
            if prompt_logprobs is not None and request.prompt_logprobs is not None:
                request.prompt_logprobs += prompt_logprobs.get(rid, ())
            if computed < len(request.all_token_ids):
                continue  # a prefill chunk that did not reach the end: no token this step
            new_tokens = sampled[rid]
            finished = False
            for i, token in enumerate(new_tokens):
                if request.append_output_token(token, max_model_len):
                    finished = True
                    del new_tokens[i + 1 :]  # nothing after a stop reaches the client
                    break
            events = request.events
            if events:
                request.events = []
            # Positional (wire field order): request_id, new_token_ids, finish_reason, stop_token_id,
            # num_cached_tokens, error, events. Keywords cost ~70 ns each, per request, per step.
            output = RequestOutput(
                rid, new_tokens, None, None, request.num_cached_tokens, None, events or None
            )
            if logprobs is not None:
                token_logprobs = logprobs.get(rid)
                if token_logprobs is not None:
                    output.logprobs = token_logprobs[: len(new_tokens)]
            if request.prompt_logprobs is not None:
                output.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            if finished:
                output.finish_reason = request.finish_reason
                output.stop_token_id = request.stop_token_id
                ledger.free(rid)
                del requests[rid]
                del self._keys[rid]
                self._finished_ids.append(rid)
                any_finished = True
            client_outputs = outputs.get(request.client_index)
            if client_outputs is None:
                outputs[request.client_index] = client_outputs = []
            client_outputs.append(output)
        if any_finished:
            self.running = [r for r in self.running if r.status is _RUNNING]
        return outputs

    # ---------------------------------------------------------------------------------------- stats

    def stats(self) -> EngineStats:
        ledger = self.ledger
        return EngineStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            kv_usage=ledger.usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=ledger.prefix_queries,
            prefix_cache_hits=ledger.prefix_hits,
        )
