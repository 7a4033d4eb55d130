"""The mock engine core (``--engine mock``): instant prefill, one random token per running request per
step, on a fixed step clock. Seed 000's frontend-stress tool: it produces engine outputs at an exact,
configurable rate so that the API server's per-token cost can be measured. The engine-core shell
(``engine/core.py``) runs it like any core (``engine/core_api.py``, which it meets structurally: this
module imports nothing from the engine): joining, inputs, aborts, heartbeats and sending are the
shell's.

No I/O and no clock of its own: the clock (trio's ``current_time`` and ``sleep_until`` in the engine)
is given to it, so ``execute`` is the only thing that waits, and only on it.

Timing model (what a GPU would do, minus the GPU): a step starts as soon as there is work and lasts
``step_interval_us``; its tokens are produced at the end of the step (``update``), for every request
running by then, including one that arrived during the step (prefill is instant). The clock's rules
are ``StepClock``'s. An abort is applied the moment the shell hands it over (as it arrives), so one
that arrives during a step lands before that step's tokens are made: a stop-string abort costs at
most one step.

Logprobs (a request's ``logprobs``/``prompt_logprobs``): made up, but shaped like a model's. Each
position gets k alternatives with logprobs sorted descending and a token id each (distinct); the token
itself is usually the most likely one (rank 1, with the top logprob) and otherwise ranks lower, with
its own logprob in its rank's place in the same descending sequence, so rank 1 holds exactly when the
token has the top logprob. Drawn from the request's RNG, so a seeded request repeats them. A request
that asks for none costs one attribute test per step.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from trioserve.config import EngineConfig, MockConfig, ModelConfig
from trioserve.protocol.messages import (
    AddRequest,
    EngineReady,
    EngineStats,
    RequestOutput,
    TokenLogprobs,
)


class StepClock:
    """When each mock step ends. Pure: the caller passes its clock.

    Rules (tokio's ``MissedTickBehavior::Delay``, as in seed 000's patch):

    - back-to-back steps follow the clock exactly: each ends ``interval`` after the previous one did,
      whatever part of the interval the work between them took (no drift from our own work);
    - a step that starts a whole interval late (the loop was busy) starts at once, and later steps
      are spaced from there;
    - after ``rest`` (the core ran out of work) the next step starts when it is asked for: a request
      that finds the engine idle waits one interval for its first token, not less.
    """

    __slots__ = ("_last_end", "interval")

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last_end = -math.inf

    def next_end(self, now: float) -> float:
        """A step begins at ``now``: when it ends (and its tokens are made)."""
        start = self._last_end if now - self._last_end < self.interval else now
        self._last_end = start + self.interval
        return self._last_end

    def rest(self) -> None:
        self._last_end = -math.inf


def mock_logprobs(rng: random.Random, token: int, k: int, vocab: int) -> TokenLogprobs:
    """Plausible logprobs for ``token`` with ``k`` alternatives (see the module docstring)."""
    rank = 1 if rng.random() < 0.7 else rng.randrange(2, k + 6)
    values = []
    value = -rng.random() * 0.5
    for _ in range(max(k, rank)):
        values.append(value)
        value -= 0.05 + rng.random() * 2.0  # strictly descending
    top_ids = []
    start = rng.randrange(1, vocab) if vocab > 1 else 0
    other = (token + start) % vocab
    for i in range(min(k, vocab)):
        if i == rank - 1:
            top_ids.append(token)
            continue
        while other == token:
            other = (other + 1) % vocab
        top_ids.append(other)
        other = (other + 1) % vocab
    return TokenLogprobs(token, values[rank - 1], rank, top_ids, values[: len(top_ids)])


@dataclass(slots=True)
class _MockRequest:
    add: AddRequest
    rng: random.Random | None  # per-request RNG when the request carries a seed, else the engine's
    stop_ids: frozenset[int]
    num_output: int = 0
    logprobs: bool = False  # asks for logprobs or prompt logprobs


@dataclass(slots=True)
class MockCore:
    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    seed: int = 0
    step_interval_us: int = 0  # 0: step as fast as possible (the loop only yields between steps)
    # The clock ``execute`` waits on (the engine passes trio's); only ``execute`` needs it.
    current_time: Callable[[], float] | None = None
    sleep_until: Callable[[float], Awaitable[None]] | None = None
    waiting: deque[_MockRequest] = field(default_factory=deque)
    running: dict[str, _MockRequest] = field(default_factory=dict)
    _rng: random.Random = field(init=False)
    _clock: StepClock = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._clock = StepClock(self.step_interval_us / 1e6)

    @classmethod
    def from_config(
        cls,
        model: ModelConfig,
        engine: EngineConfig,
        mock: MockConfig,
        *,
        current_time: Callable[[], float],
        sleep_until: Callable[[float], Awaitable[None]],
    ) -> MockCore:
        return cls(
            vocab_size=model.vocab_size,
            max_num_seqs=engine.max_num_seqs,
            max_model_len=model.max_model_len,
            seed=mock.mock_seed,
            step_interval_us=mock.step_interval_us,
            current_time=current_time,
            sleep_until=sleep_until,
        )

    def ready(self, engine_index: int, pid: int) -> EngineReady:
        return EngineReady(
            engine_index=engine_index,
            pid=pid,
            kind="mock",
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            vocab_size=self.vocab_size,
        )

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def failure(self) -> None:
        return None  # nothing here can fail

    def wake_on_failure(self, wake: Callable[[], None]) -> None:
        pass

    def add(self, add: AddRequest) -> RequestOutput | None:
        """Queue a request, or return the error output that rejects it at once."""
        prompt_len = len(add.prompt_token_ids)
        if prompt_len == 0 or prompt_len >= self.max_model_len:
            return RequestOutput(
                add.request_id,
                [],
                finish_reason="error",
                error=f"prompt of {prompt_len} tokens does not fit max_model_len {self.max_model_len}",
            )
        sp = add.sampling
        stop_ids = set(sp.stop_token_ids)
        if add.eos_token_id is not None and not sp.ignore_eos:
            stop_ids.add(add.eos_token_id)
        rng = random.Random(sp.seed) if sp.seed is not None else None
        wants = sp.logprobs is not None or sp.prompt_logprobs is not None
        self.waiting.append(_MockRequest(add, rng, frozenset(stop_ids), logprobs=wants))
        return None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is None:
                # Rare (abort before the first step): a linear scan of the waiting queue is fine.
                self.waiting = deque(r for r in self.waiting if r.add.request_id != rid)

    def client_requests(self, client_index: int) -> list[str]:
        held = (*self.waiting, *self.running.values())
        return [r.add.request_id for r in held if r.add.client_index == client_index]

    def schedule(self) -> int | None:
        """A step when there is work: one token for each request running at its end (at most
        ``max_num_seqs``); without work the clock rests."""
        if not self.has_work:
            self._clock.rest()
            return None
        return min(len(self.running) + len(self.waiting), self.max_num_seqs)

    async def execute(self) -> None:
        """The step's duration on the clock. With no interval the step ends at once, but the wait
        still yields, so the input pumps run between steps."""
        if self.current_time is None or self.sleep_until is None:
            raise RuntimeError("a MockCore runs steps only with a clock (current_time, sleep_until)")
        await self.sleep_until(self._clock.next_end(self.current_time()))

    def update(self) -> dict[int, list[RequestOutput]]:
        """Admit what fits, then emit one token for every running request (prefill is instant).

        Returns the outputs grouped by ``client_index`` (the API server that owns each request).
        """
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            self.running[req.add.request_id] = req
        outputs: dict[int, list[RequestOutput]] = {}
        finished: list[str] = []
        engine_rng = self._rng
        vocab = self.vocab_size
        for rid, req in self.running.items():
            rng = req.rng or engine_rng
            token = rng.randrange(vocab)
            req.num_output += 1
            sp = req.add.sampling
            out = RequestOutput(rid, [token])
            if req.logprobs:  # the only per-step cost for a request that asks for none
                self._add_logprobs(out, req, rng, token)
            if token in req.stop_ids and req.num_output > sp.min_tokens:
                out.finish_reason = "stop"
                out.stop_token_id = token
            elif (
                req.num_output >= sp.max_tokens
                or len(req.add.prompt_token_ids) + req.num_output >= self.max_model_len
            ):
                out.finish_reason = "length"
            if out.finish_reason is not None:
                finished.append(rid)
            client_outputs = outputs.get(req.add.client_index)
            if client_outputs is None:
                outputs[req.add.client_index] = client_outputs = []
            client_outputs.append(out)
        for rid in finished:
            del self.running[rid]
        return outputs

    def _add_logprobs(self, out: RequestOutput, req: _MockRequest, rng: random.Random, token: int) -> None:
        """The output token's logprobs, and on the first output the prompt's (one per prompt token,
        the first None: nothing precedes it), as the request asks."""
        sp, vocab = req.add.sampling, self.vocab_size
        if sp.logprobs is not None:
            out.logprobs = [mock_logprobs(rng, token, sp.logprobs, vocab)]
        k = sp.prompt_logprobs
        if k is not None and req.num_output == 1:
            prompt = req.add.prompt_token_ids
            out.prompt_logprobs = [None, *(mock_logprobs(rng, t, k, vocab) for t in prompt[1:])]

    def stats(self) -> EngineStats:
        return EngineStats(num_waiting=len(self.waiting), num_running=len(self.running))
