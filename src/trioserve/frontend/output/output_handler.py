"""The output handler: once per engine step, the per-token work for every request in one pass.

For each request output in a step: incremental detokenize, stop-string check, hand the delta to the
request's response (which encodes and writes it, or merges it while its sink is backlogged). Nothing
here awaits, so one step costs one task wakeup however many requests it carries, and requests that
hit a stop string are aborted on the engine in one message at the end of the step (the abort fast
path: the engine client sends aborts ahead of any queued adds).

The step queue here also remembers when each queued step arrived (trio clock), so the handler and
admission know the *output delay*: how long engine output waits in this API server before the handler
takes it. It is near zero while the handler keeps up, and grows with the backlog when it does not —
the signal ``--max-output-delay-ms`` sheds new requests on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from trioserve.frontend.output.logprobs import echo_logprobs
from trioserve.frontend.output.responses import Response, StreamingResponse
from trioserve.frontend.output.step_queue import QueuePolicy, StepQueue
from trioserve.frontend.text.detokenizer import Detokenizer
from trioserve.frontend.text.stop_strings import StopStringMatcher
from trioserve.metrics import Metrics
from trioserve.protocol.messages import (
    EngineOutputs,
    EngineStats,
    FinishReason,
    RequestEvent,
    RequestOutput,
)

log = logging.getLogger("trioserve.frontend")


@dataclass(slots=True)
class ChoiceState:
    """One engine request: one choice of one response."""

    request_id: str
    index: int
    response: Response
    detokenizer: Detokenizer
    stop: StopStringMatcher | None
    include_stop: bool = False  # keep the text of a stop token / stop string (vLLM's flag)
    arrival: float = 0.0  # wall clock when the API server received the request
    last_token_time: float = 0.0  # wall clock of the last delivery; 0 until the first token
    queued_at: float = 0.0  # the engine's "queued" stamp, until its first "scheduled" one
    # The response shows logprobs, or echoes the prompt: its deltas take ``OutputHandler._extras``.
    extras: bool = False
    echo: str | None = None  # the prompt's text, until the first delta carries it (completions' echo)


class StampedStepQueue(StepQueue):
    """The step queue, plus the time (trio clock) each queued step arrived from the output pump and
    how long the handler takes per step while it is behind.

    A step folded into the last queued one (``coalesce``) keeps that one's stamp: its oldest token has
    waited since then. Under ``block`` the stamp is taken before the pump waits for room.
    """

    SMOOTHING = 0.5  # weight of the newest per-step service time in its moving average

    def __init__(self, size: int, policy: QueuePolicy) -> None:
        super().__init__(size, policy)
        self._arrived: deque[float] = deque()  # one per queued step, oldest first
        self.last_wait = 0.0  # how long the step last taken had waited (seconds)
        self.service_time = 0.0  # seconds per step the handler takes, averaged
        self._last_taken: float | None = None

    async def put(self, step: EngineOutputs) -> None:
        now = trio.current_time()
        coalesced = self.coalesced
        await super().put(step)
        if self.coalesced == coalesced:  # appended, not folded (only the pump puts: order holds)
            self._arrived.append(now)

    async def get(self) -> EngineOutputs:
        called = trio.current_time()
        behind = bool(self._arrived)  # a step was already waiting: the handler will not wait for one
        step = await super().get()
        now = trio.current_time()
        self.last_wait = max(0.0, now - self._arrived.popleft())
        if self._last_taken is not None:
            # What the last step cost: the whole interval when the handler went straight on to this
            # one (its own work and everything else the event loop did meanwhile), else its own work
            # up to asking for the next one.
            sample = (now if behind else called) - self._last_taken
            self.service_time += self.SMOOTHING * (sample - self.service_time)
        self._last_taken = now
        return step

    def delay_estimate(self, now: float) -> float:
        """How long output produced now would wait before the handler takes it: at least as long as
        the oldest queued step has waited, and at least the queued steps times the time per step."""
        if not self._arrived:
            return 0.0
        return max(now - self._arrived[0], len(self._arrived) * self.service_time)


class OutputHandler:
    def __init__(self, abort: Callable[[list[str]], None], metrics: Metrics) -> None:
        self._abort = abort
        self.metrics = metrics
        self.steps: StampedStepQueue | None = None  # set by ``run``
        self.choices: dict[str, ChoiceState] = {}
        self.engine_stats: dict[int, EngineStats] = {}
        # When each engine's stats were taken in (trio clock): admission ignores stale ones.
        self.engine_stats_at: dict[int, float] = {}
        # Under the "stall" stream policy: responses whose clients fell behind during the last step;
        # the next step waits until they have caught up.
        self.stalled: list[StreamingResponse] = []
        self.stalled_waiting = 0  # slow clients the handler is waiting on right now ("stall")

    def register(self, choice: ChoiceState) -> None:
        self.choices[choice.request_id] = choice

    def forget(self, request_ids: list[str]) -> list[str]:
        """Drop these requests; returns the ones that were still running (the caller aborts them)."""
        return [rid for rid in request_ids if self.choices.pop(rid, None) is not None]

    def output_delay(self) -> float:
        """How long engine output produced now would wait for this handler (seconds; 0 if none
        waits): what admission's ``--max-output-delay-ms`` compares."""
        steps = self.steps
        return steps.delay_estimate(trio.current_time()) if steps is not None else 0.0

    async def run(self, steps: StepQueue) -> None:
        stamped = steps if isinstance(steps, StampedStepQueue) else None
        self.steps = stamped
        while True:
            step = await steps.get()
            if stamped is not None:
                self.metrics.output_delay.observe(stamped.last_wait)
            self.process(step)
            while self.stalled:
                self.stalled_waiting = len(self.stalled)
                await self._wait_caught_up(self.stalled.pop())
            self.stalled_waiting = 0

    @staticmethod
    async def _wait_caught_up(response: StreamingResponse) -> None:
        """Until the client has taken what was waiting for it (or the response is over)."""
        if response.done or not response.sink.backlogged:
            return
        caught_up = trio.Event()
        response.on_caught_up = caught_up.set
        await caught_up.wait()

    def engine_stats_ages(self, now: float) -> list[tuple[EngineStats, float]]:
        """Each engine's latest stats with their age in seconds (``now``: trio clock)."""
        at = self.engine_stats_at
        return [(stats, now - at[index]) for index, stats in self.engine_stats.items()]

    def process(self, step: EngineOutputs) -> None:
        self.engine_stats[step.engine_index] = step.stats
        self.engine_stats_at[step.engine_index] = trio.current_time()
        if not step.outputs:
            return  # an idle engine's report or heartbeat: stats only
        choices = self.choices
        to_abort: list[str] = []
        tokens = 0
        prefilled = 0  # prompt tokens of the requests this step gave a first token (vLLM counts them so)
        metrics = self.metrics
        now = time.time()
        for out in step.outputs:
            choice = choices.get(out.request_id)
            if choice is None:
                continue  # finished or cancelled here; the engine's abort may still be in flight
            ids = out.new_token_ids
            tokens += len(ids)
            finish = out.finish_reason
            if out.events:
                self._observe_events(choice, out.events)
            if finish == "error":
                del choices[out.request_id]
                choice.response.fail(400, out.error or "the engine failed this request")
                continue
            if choice.last_token_time:
                metrics.itl.observe(now - choice.last_token_time)
            else:
                metrics.ttft.observe(now - choice.arrival)
                prefilled += choice.response.first_token(choice.index, now)
            choice.last_token_time = now
            detok = choice.detokenizer
            stop_reason: int | str | None = out.stop_token_id
            if choice.extras:  # the one test a request without logprobs or echo pays per delta
                text, finish, stop_reason = self._extras(choice, out, finish, stop_reason, to_abort)
            else:
                if stop_reason is not None and not choice.include_stop:
                    # The stop token ends the text; like vLLM, its own text is not shown.
                    text = detok.step_many(ids[:-1])
                else:
                    text = detok.step(ids[0]) if len(ids) == 1 else detok.step_many(ids)
                if choice.stop is not None:
                    result = choice.stop.feed(text)
                    text = result.text
                    if result.matched is not None:
                        if finish is None:
                            to_abort.append(out.request_id)
                        finish, stop_reason = "stop", result.matched
                    elif finish is not None:
                        text += choice.stop.flush()
            if finish is not None:
                del choices[out.request_id]
                metrics.e2e.observe(now - choice.arrival)
                metrics.finished[finish] = metrics.finished.get(finish, 0) + 1
            choice.response.on_delta(choice.index, text, ids, finish, stop_reason)
        metrics.generation_tokens += tokens
        if tokens or prefilled:  # a step of requests already gone here is not one of ours
            metrics.iteration_tokens.observe(tokens + prefilled)
        if to_abort:
            self._abort(to_abort)

    @staticmethod
    def _extras(
        choice: ChoiceState,
        out: RequestOutput,
        finish: FinishReason | None,
        stop_reason: int | str | None,
        to_abort: list[str],
    ) -> tuple[str, FinishReason | None, int | str | None]:
        """``process``'s text and stop-string step for a choice that shows logprobs or echoes its
        prompt: it also hands the response the logprobs of the delta's tokens, and puts the prompt
        (its text, and with logprobs its logprobs) before the first delta's. Returns the text, finish
        and stop reason.

        The rule for stop strings: a stop string's match is found token by token, and the logprobs of
        every token up to and including the one whose text completes the match are kept; tokens after
        it in the same delta (several tokens per delta: a folded step) are dropped, as their text is.
        A stop token's own logprob is kept (the engine sampled it), though its text is not shown."""
        ids = out.new_token_ids
        response = choice.response
        entries = out.logprobs or []
        detok = choice.detokenizer
        shown = ids[:-1] if stop_reason is not None and not choice.include_stop else ids
        stop = choice.stop
        if stop is None:
            text = detok.step_many(shown)
        else:
            parts = []
            for k, token_id in enumerate(shown):
                result = stop.feed(detok.step(token_id))
                parts.append(result.text)
                if result.matched is not None:
                    if finish is None:
                        to_abort.append(out.request_id)
                    finish, stop_reason = "stop", result.matched
                    entries = entries[: k + 1]
                    break
            else:
                if finish is not None:
                    parts.append(stop.flush())
            text = "".join(parts)
        if choice.echo is not None:  # the first delta: the prompt comes first (not stop-checked)
            text = choice.echo + text
            choice.echo = None
            if response.logprobs is not None:
                prompt = response.prompts[choice.index // response.options.n]
                k = response.options.logprobs or 0
                entries = [*echo_logprobs(prompt, out.prompt_logprobs, k), *entries]
        if out.prompt_logprobs is not None and response.options.prompt_logprobs is not None:
            response.on_prompt_logprobs(choice.index, out.prompt_logprobs)
        if response.logprobs is not None:
            response.on_logprobs(choice.index, entries)
        return text, finish, stop_reason

    def _observe_events(self, choice: ChoiceState, events: list[RequestEvent]) -> None:
        """Queue time from the engine's own stamps: queued -> first scheduled (rare: per request)."""
        for event in events:
            if event.kind == "queued":
                choice.queued_at = event.timestamp
            elif event.kind == "scheduled" and choice.queued_at:
                self.metrics.queue_time.observe(event.timestamp - choice.queued_at)
                choice.queued_at = 0.0

    def fail_all(self, status: int, message: str) -> None:
        """Every running request ends with an error the client sees (the engine is gone, or drain's
        deadline came). Each response's end aborts its engine requests as any end does
        (``Serving._on_done``): a request whose add is still queued is then never sent, so none is
        left to run for nobody on an engine that comes back."""
        responses = {id(c.response): c.response for c in self.choices.values()}
        for response in responses.values():
            response.fail(status, message)
        self.choices.clear()

    def fail(self, request_ids: list[str], status: int, message: str) -> None:
        """The responses these engine requests belong to end with an error (their engine is gone
        while others serve); like ``fail_all``, each end aborts the response's other choices."""
        responses = {id(c.response): c.response for rid in request_ids if (c := self.choices.get(rid))}
        for response in responses.values():
            response.fail(status, message)
            for rid in response.request_ids:
                self.choices.pop(rid, None)
