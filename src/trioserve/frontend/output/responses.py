"""Response state for one HTTP (or WebSocket) request: its choices, merging, usage, completion.

The output handler calls ``on_delta`` with each choice's new text and token ids once per engine step;
the response turns that into chunks on its sink. Invariants:

- a chunk is encoded only when it can be written: while the sink is backlogged, deltas of a choice are
  merged (text concatenated, token ids appended, the finish reason kept) and encoded once on drain;
- ``done`` is set exactly once, after the last byte of the response has been handed to the sink, on
  every path: normal finish, engine error, or the engine going away;
- usage counts every token the engine produced for the response (prompt counted once, as OpenAI does);
- a response is built whole (everything it needs is a constructor argument) and attaches itself to its
  sink, which tells it when the client caught up (``on_drained``).

Responses are pure: no trio, no I/O. They write to a ``ResponseSink`` (the edge's ``Sink``) and wake
whoever waits for them through plain callables.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from trioserve.config import StreamPolicy
from trioserve.frontend.output.chunks import Choice, ChunkEncoder, full_body
from trioserve.frontend.output.logprobs import LogprobsFormat
from trioserve.frontend.output.tool_calls import ToolFormat, tool_message
from trioserve.frontend.replica_slots import Reservation
from trioserve.frontend.request.admission import Ticket
from trioserve.frontend.request.errors import ApiError
from trioserve.frontend.request.validate import OutputOptions
from trioserve.protocol.messages import SamplingParams, TokenLogprobs


class Wakeable(Protocol):
    def set(self) -> None: ...


class ResponseSink(Protocol):
    """What a response needs of the transport its bytes go to (``frontend/edge/sinks.py:Sink``)."""

    response: Response | None  # set by the response: the sink tells it when the client caught up

    @property
    def backlogged(self) -> bool: ...
    @property
    def backlog_bytes(self) -> int: ...
    @property
    def started(self) -> bool: ...
    @property
    def waker(self) -> Wakeable:
        """Set when the response is complete: the task that owns the transport finishes it."""
        ...

    def event(self, payload: bytes) -> None: ...
    def events(self, payloads: list[bytes]) -> None: ...
    def end(self) -> None: ...
    def full(self, status: int, body: bytes) -> None: ...


@dataclass(slots=True)
class _Pending:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Response(ABC):
    """Common state: which choices are still running, token counts, completion."""

    def __init__(
        self,
        sink: ResponseSink,
        encoder: ChunkEncoder,
        options: OutputOptions,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        ticket: Ticket,
        on_done: Callable[[Response], None],
        *,
        prompts: list[list[int]] | None = None,
        logprobs: LogprobsFormat | None = None,
    ) -> None:
        """``params``: what the engine is asked for; ``ticket``: the admission slot, released when the
        response retires; ``on_done``: called once, when the response completes; ``prompts``: every
        prompt of a request with several (``/v1/completions``), the first being ``prompt_token_ids``.
        Choice ``i`` is sample ``i % n`` of prompt ``i // n``, as OpenAI numbers them. ``logprobs``:
        how to render logprobs, for a request that asks for them or for ``prompt_logprobs`` (None:
        it asks for neither). ``self.logprobs`` is set only when the output's are shown."""
        self.logprobs = logprobs if options.logprobs is not None else None
        self.token_format = logprobs
        self.sink = sink
        self.encoder = encoder
        self.options = options
        self.prompt_token_ids = prompt_token_ids
        self.prompts = prompts if prompts is not None else [prompt_token_ids]
        self.prompt_tokens = sum(len(p) for p in self.prompts)  # usage: each prompt counted once
        choices = len(self.prompts) * options.n
        self.params = params
        self.priority = priority
        self.timeout_s: float | None = None  # the request's own deadline without output (timeout_ms)
        self.reservation: Reservation | None = None  # least-outstanding-bytes: its replica's slot
        # A chat request whose tools may produce calls: how its text becomes tool calls (streams get a
        # ToolChunkEncoder built from it as their encoder; full responses read it in _body).
        self.tool_format: ToolFormat | None = None
        self.ticket = ticket
        self.completion_tokens = 0
        self.first_token_time = 0.0  # wall clock of the first token of any choice; 0 before it
        self.remaining = choices
        self.done = False
        # One engine request per choice; the id is also the response's key in the output handler.
        self.request_ids = [f"{encoder.id}-{i}" for i in range(choices)]
        self._on_done = on_done
        # Per choice: logprobs handed over and not rendered yet (those of merged deltas accumulate),
        # and, for completions, the text offset the next token starts at.
        self._logprobs: list[list[TokenLogprobs]] = [[] for _ in range(choices)] if logprobs else []
        self._text_offset = [0] * choices if logprobs else []
        self._start(choices)
        sink.response = self

    @abstractmethod
    def _start(self, n: int) -> None:
        """Set up the per-choice state of a response with ``n`` choices."""

    def first_token(self, index: int, now: float) -> int:
        """Choice ``index`` got its first token at ``now`` (wall clock; once per choice, never per
        token): stamps the response's first token (access log, time per output token) and returns
        that choice's prompt length, the tokens its prefill processed (``iteration_tokens``)."""
        if not self.first_token_time:
            self.first_token_time = now
        return len(self.prompts[index // self.options.n])

    @abstractmethod
    def on_delta(
        self, index: int, text: str, token_ids: list[int], finish: str | None, stop_reason: int | str | None
    ) -> None:
        """New text and token ids of one choice from one engine step; ``finish`` ends that choice."""

    def on_logprobs(self, index: int, entries: list[TokenLogprobs]) -> None:
        """The logprobs of the tokens of choice ``index``'s next ``on_delta`` (called just before it,
        only for a response with ``logprobs``)."""
        self._logprobs[index] += entries

    def on_prompt_logprobs(self, index: int, entries: list[TokenLogprobs | None]) -> None:  # noqa: B027
        """vLLM's ``prompt_logprobs`` of choice ``index`` (a full response shows them; streams refuse
        them in validation)."""

    def _take_logprobs(self, index: int) -> bytes:
        """The JSON of choice ``index``'s logprobs handed over since the last call."""
        fmt = self.logprobs
        assert fmt is not None
        entries, self._logprobs[index] = self._logprobs[index], []
        if fmt.kind == "chat":
            return fmt.chat(entries)
        body, self._text_offset[index] = fmt.completion(entries, self._text_offset[index])
        return body

    def on_drained(self) -> None:  # noqa: B027  (deliberately a no-op: only streams merge)
        """The sink caught up: write what was merged while it was backlogged."""

    # Gauges for /metrics, read at scrape time (never on the token path). A full response writes once,
    # as it completes, so nothing of it ever waits for its client.

    @property
    def backlogged(self) -> bool:
        """A streamed response whose client has not taken every byte written yet."""
        return False

    @property
    def backlog_bytes(self) -> int:
        """Bytes this response's sink holds for its client (0 where the sink shares its socket)."""
        return 0

    @property
    def merged_tokens(self) -> int:
        """Tokens merged and waiting for the client to catch up (0 while it keeps up)."""
        return 0

    @abstractmethod
    def fail(self, status: int, message: str) -> None:
        """End the response with an error the client sees."""

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self._on_done(self)
            self.sink.waker.set()


class StreamingResponse(Response):
    def __init__(
        self,
        sink: ResponseSink,
        encoder: ChunkEncoder,
        options: OutputOptions,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        ticket: Ticket,
        on_done: Callable[[Response], None],
        *,
        policy: StreamPolicy,
        stalled: list[StreamingResponse] | None = None,
        prompts: list[list[int]] | None = None,
        logprobs: LogprobsFormat | None = None,
    ) -> None:
        """``policy``: what to do while the client is behind (``--stream-policy``); ``stalled``: under
        ``stall``, the output handler's list of responses it waits for before its next step."""
        self.policy = policy
        self.stalled = stalled
        # Called once the client caught up (or the response ended), then cleared: set by a task that
        # waits for that (the output handler, under ``stall``).
        self.on_caught_up: Callable[[], None] | None = None
        super().__init__(
            sink,
            encoder,
            options,
            prompt_token_ids,
            params,
            priority,
            ticket,
            on_done,
            prompts=prompts,
            logprobs=logprobs,
        )

    def _start(self, n: int) -> None:
        self._role_pending = [self.encoder.kind == "chat"] * n  # chat choices open with a role chunk
        self._pending: dict[int, _Pending] = {}
        self._pending_tokens = 0  # tokens merged while the sink is backlogged
        self._queued = 0  # chunks queued behind the socket since it last drained (queue:N)
        self._stall_listed = False
        self.merged_deltas = 0
        self.content_events = 0  # chunks that carried a delta (not role or usage chunks)

    @property
    def backlogged(self) -> bool:
        return self.sink.backlogged

    @property
    def backlog_bytes(self) -> int:
        return self.sink.backlog_bytes

    @property
    def merged_tokens(self) -> int:
        return self._pending_tokens if self._pending else 0

    def _caught_up(self) -> None:
        wake = self.on_caught_up
        if wake is not None:
            self.on_caught_up = None
            wake()

    def on_delta(
        self, index: int, text: str, token_ids: list[int], finish: str | None, stop_reason: int | str | None
    ) -> None:
        self.completion_tokens += len(token_ids)
        if finish is not None:
            self.remaining -= 1
        sink = self.sink
        if not (self._pending or sink.backlogged or self.remaining == 0 or self._role_pending[index]):
            # The common case, once per token: one chunk, written at once.
            self.content_events += 1
            lp = None if self.logprobs is None else self._take_logprobs(index)
            sink.event(
                self.encoder.delta(index, text, token_ids, finish, stop_reason, self.completion_tokens, lp)
            )
            return
        if sink.backlogged and not self._pending and self._queued < self.policy.queue_events:
            self._queued += 1  # queue:N: this chunk queues behind the socket as it is
        elif sink.backlogged or self._pending:
            self._merge(index, text, token_ids, finish, stop_reason)
            return
        payloads = []
        if self._role_pending[index]:
            self._role_pending[index] = False
            payloads.append(self.encoder.role(index))
        lp = None if self.logprobs is None else self._take_logprobs(index)
        payloads.append(
            self.encoder.delta(index, text, token_ids, finish, stop_reason, self.completion_tokens, lp)
        )
        self.content_events += 1
        if self.remaining == 0:
            payloads += self._tail()
        sink.events(payloads)
        if self.remaining == 0:
            self._end()

    def _merge(
        self, index: int, text: str, token_ids: list[int], finish: str | None, stop_reason: int | str | None
    ) -> None:
        merged = self._pending.get(index)
        if merged is None:
            self._pending[index] = merged = _Pending()
        merged.text += text
        merged.token_ids += token_ids
        if finish is not None:
            merged.finish_reason, merged.stop_reason = finish, stop_reason
        self.merged_deltas += 1
        self._pending_tokens += len(token_ids)
        policy = self.policy
        if not self.sink.backlogged:
            self.on_drained()
        elif policy.kind == "abort-slow-client" and self._pending_tokens > policy.slow_client_max_tokens:
            self.fail(503, f"client too slow: more than {policy.slow_client_max_tokens} tokens behind")
        elif policy.kind == "stall" and self.stalled is not None and not self._stall_listed:
            self._stall_listed = True
            self.stalled.append(self)

    def on_drained(self) -> None:
        self._queued = 0
        self._stall_listed = False
        self._caught_up()
        if self.done or not self._pending:
            return
        self._pending_tokens = 0
        payloads = []
        for index, merged in sorted(self._pending.items()):
            if self._role_pending[index]:
                self._role_pending[index] = False
                payloads.append(self.encoder.role(index))
            payloads.append(
                self.encoder.delta(
                    index,
                    merged.text,
                    merged.token_ids,
                    merged.finish_reason,
                    merged.stop_reason,
                    self.completion_tokens,
                    None if self.logprobs is None else self._take_logprobs(index),
                )
            )
        self.content_events += len(self._pending)
        self._pending.clear()
        if self.remaining == 0:
            payloads += self._tail()
        self.sink.events(payloads)
        if self.remaining == 0:
            self._end()

    def _tail(self) -> list[bytes]:
        if self.options.include_usage:
            return [self.encoder.usage(self.prompt_tokens, self.completion_tokens)]
        return []

    def _end(self) -> None:
        self.sink.end()
        self._finish()
        self._caught_up()

    def fail(self, status: int, message: str) -> None:
        """One error event, then the end of the stream; or a plain error response if nothing was
        written yet (an engine that refuses a request before its first token)."""
        if self.done:
            return
        if not self.sink.started:
            self.sink.full(status, ApiError(status, message).body())
            self._finish()
            return
        self.on_drained()
        self.sink.events([ApiError(status, message).body()])
        self._end()


class CollectingResponse(Response):
    """A non-streamed response: collects every choice and writes one JSON body at the end."""

    def _start(self, n: int) -> None:
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._ids: list[list[int]] = [[] for _ in range(n)]
        self._finish_reasons: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        self._prompt_logprobs: list[bytes | None] = [None] * n

    def on_prompt_logprobs(self, index: int, entries: list[TokenLogprobs | None]) -> None:
        k = self.options.prompt_logprobs
        if self.token_format is not None and k is not None:
            self._prompt_logprobs[index] = self.token_format.prompt(entries, k)

    def on_delta(
        self, index: int, text: str, token_ids: list[int], finish: str | None, stop_reason: int | str | None
    ) -> None:
        self.completion_tokens += len(token_ids)
        self._texts[index].append(text)
        self._ids[index] += token_ids
        if finish is None:
            return
        self._finish_reasons[index] = (finish, stop_reason)
        self.remaining -= 1
        if self.remaining == 0:
            self.sink.full(200, self._body())
            self._finish()

    def _body(self) -> bytes:
        chat = self.encoder.kind == "chat"
        keep_ids = self.options.return_token_ids
        n, prompts = self.options.n, self.prompts
        choices = []
        for i in range(len(self._texts)):
            text = "".join(self._texts[i])
            lp = self._prompt_logprobs[i]
            finish, stop_reason = self._finish_reasons[i]
            message: dict[str, Any] | None = {"role": "assistant", "content": text} if chat else None
            if chat and self.tool_format is not None:
                message, made_call = tool_message(text, self.tool_format)
                finish = self.tool_format.finish_reason(finish, made_call)
            choices.append(
                Choice(
                    index=i,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    message=message,
                    text=None if chat else text,
                    token_ids=self._ids[i] if keep_ids else None,
                    logprobs=None if self.logprobs is None else msgspec.Raw(self._take_logprobs(i)),
                    # Completions: each choice's own prompt, where vLLM puts it.
                    prompt_token_ids=prompts[i // n] if keep_ids and not chat else None,
                    prompt_logprobs=None if chat or lp is None else msgspec.Raw(lp),
                )
            )
        return full_body(
            self.encoder.kind,
            self.encoder.id,
            self.encoder.created,
            self.options.model,
            choices,
            self.prompt_tokens,
            self.completion_tokens,
            self.prompt_token_ids if keep_ids and len(prompts) == 1 else None,
            self._prompt_logprobs[0] if chat else None,  # chat: the response's, as vLLM puts it
        )

    def fail(self, status: int, message: str) -> None:
        if self.done:
            return
        self.sink.full(status, ApiError(status, message).body())
        self._finish()
