"""The engine's view of one request: its tokens, how far they are computed, and why it stopped.

Built from a wire ``AddRequest`` by the input pump, which also hashes the prompt's full blocks here (so
that work overlaps the forward pass instead of delaying a step). Pure: no clock is read; every event
timestamp comes from the caller.

Token bookkeeping (the scheduler's whole model of a request):

- ``all_token_ids`` = prompt + output tokens so far; ``num_tokens`` is its length.
- ``num_computed_tokens`` counts the tokens whose KV is written. Invariant while running:
  ``num_computed_tokens < num_tokens`` (the newest sampled token is never computed yet), so every step
  has at least one token to compute for every unfinished request.
- Preemption resets ``num_computed_tokens`` to 0 and keeps the outputs: on resume, prompt *and* outputs
  are recomputed as one longer prompt, so a deterministic model continues exactly where it stopped.

Prompt logprobs (``SamplingParams.prompt_logprobs``): ``prompt_logprobs`` gathers them, chunk by chunk
(the first prompt token has none: ``None``), until the first output takes them; from then on it is
None and ``sent_prompt_logprobs`` holds. While they are wanted (``wants_prompt_logprobs``) the prompt
must be computed from position 0, since a prefix-cache hit has no logits; a preemption before the first
output starts the gathering over with the recompute.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from trioserve.engine.block_hash import BlockHash, extend_block_hashes
from trioserve.protocol.messages import (
    AddRequest,
    FinishReason,
    RequestEvent,
    RequestEventKind,
    SamplingParams,
    TokenLogprobs,
)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds KV blocks; scheduled every step it gets budget
    PREEMPTED = "preempted"  # lost its blocks; back in the waiting queue at its old place
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token id
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # rejected at add time


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # API server wall clock, from the wire
    priority: int = 0  # lower runs first under the "priority" policy
    client_index: int = 0  # the API server that owns it: outputs go there
    eos_token_id: int | None = None
    cache_salt: str | None = None
    block_size: int = 0  # 0: no block hashes (prefix caching off)

    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(init=False, default_factory=list)
    num_computed_tokens: int = field(init=False, default=0)
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    # Hashes of the full blocks of all_token_ids (prompt and outputs), extended as outputs fill blocks.
    block_hashes: list[BlockHash] = field(init=False, default_factory=list)
    num_cached_tokens: int = field(init=False, default=-1)  # prefix-cache hit at first scheduling; -1 before
    num_preemptions: int = field(init=False, default=0)
    stop_token_id: int | None = field(init=False, default=None)  # the token that stopped it
    # Token ids that end the request: stop_token_ids always, EOS unless ignore_eos.
    stop_ids: frozenset[int] = field(init=False)
    # Events not yet reported; they ride on the request's next RequestOutput.
    events: list[RequestEvent] = field(init=False, default_factory=list)
    # With prompt_logprobs: those gathered so far, until the first output takes them (then None).
    prompt_logprobs: list[TokenLogprobs | None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        stop_ids = set(self.sampling.stop_token_ids)
        if self.eos_token_id is not None and not self.sampling.ignore_eos:
            stop_ids.add(self.eos_token_id)
        self.stop_ids = frozenset(stop_ids)
        if self.block_size:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt)

    @classmethod
    def from_add(cls, add: AddRequest, *, block_size: int, now: float) -> Request:
        """Build from the wire struct, hash the prompt's blocks, and record "queued" at ``now``."""
        req = cls(
            request_id=add.request_id,
            prompt_token_ids=add.prompt_token_ids,
            sampling=add.sampling,
            arrival_time=add.arrival_time,
            priority=add.priority,
            client_index=add.client_index,
            eos_token_id=add.eos_token_id,
            cache_salt=add.cache_salt,
            block_size=block_size,
        )
        req.record_event("queued", now)
        return req

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for and not sent yet: no prefix-cache lookup for it then."""
        return self.prompt_logprobs is not None

    @property
    def sent_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is None and self.sampling.prompt_logprobs is not None

    def restart_prompt_logprobs(self) -> None:
        """Preempted before its first output: the recompute sends them all again from the start."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int, max_model_len: int) -> bool:
        """Append a sampled token, then apply the stop rules; True if the request just finished.

        Rules (the engine owns these; stop *strings* belong to the API server):
        - a stop token (stop_token_ids, or EOS unless ignore_eos) stops it, but only once more than
          ``min_tokens`` outputs exist: the first ``min_tokens`` outputs cannot be a stop;
        - ``max_tokens`` outputs, or ``max_model_len`` tokens in all, end it with "length".
        A stop token is kept in the output (the API server decides whether to show it).
        One method for both because it runs once per request per step.
        """
        output = self.output_token_ids
        tokens = self.all_token_ids
        output.append(token_id)
        tokens.append(token_id)
        bs = self.block_size
        if bs and len(tokens) % bs == 0:
            extend_block_hashes(self.block_hashes, tokens, bs, self.cache_salt)
        num_output = len(output)
        if token_id in self.stop_ids and num_output > self.sampling.min_tokens:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_token_id = token_id
            return True
        if num_output >= self.sampling.max_tokens or len(tokens) >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def record_event(self, kind: RequestEventKind, now: float) -> None:
        self.events.append(RequestEvent(kind, now))
