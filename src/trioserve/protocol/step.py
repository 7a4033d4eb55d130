"""What one engine step asks of the model runner: the scheduler's output, as it crosses the
shared-memory ring to every worker (``engine/scheduler.py`` says how it is built).

Block-table format: a request scheduled for the first time (or the first time since it was preempted,
when the runner has dropped it) comes in ``new_requests`` with its whole block table and its sampling
params; a request the runner already knows comes in ``running_requests`` with only the block ids
appended this step (the runner keeps each table and extends it). Both carry the exact token ids to
compute this step and the position of the first one (``num_computed_tokens``).

msgspec Structs, ``array_like`` and ``gc=False``: a step is encoded once per step on the hot path.
"""

from __future__ import annotations

import msgspec

from trioserve.protocol.messages import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_TOKENS,
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMARS_PER_STEP,
    MAX_LOGIT_BIAS_ENTRIES,
    SamplingParams,
)


class NewRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the runner does not know yet (first scheduling, or resumed after preemption)."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step, at positions num_computed_tokens, +1, ...
    num_computed_tokens: int  # tokens whose KV is already in the blocks (a prefix-cache hit)
    block_ids: list[int]  # the whole block table
    sampling: SamplingParams
    samples: bool  # this chunk reaches the last known token: the step's sample is the next output
    # For the sampler: where the outputs start (output index = position of the sampled token minus
    # this, stable across preemption, which keeps seeded sampling reproducible) and the EOS that
    # min_tokens suppresses.
    num_prompt_tokens: int = 0
    eos_token_id: int | None = None


class RunningRequestData(msgspec.Struct, array_like=True, gc=False):
    """A request the runner already holds (it keeps its block table and sampling params)."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step (one, the last sampled, when decoding)
    num_computed_tokens: int
    new_block_ids: list[int]  # appended to the runner's block table for this request
    samples: bool


class SchedulerOutput(msgspec.Struct, array_like=True, gc=False):
    step: int
    new_requests: list[NewRequestData]
    running_requests: list[RunningRequestData]
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens computed this step
    total_num_scheduled_tokens: int
    preempted_request_ids: list[str]  # dropped by the runner: they will come back as new requests
    finished_request_ids: list[str]  # finished or aborted since the last step: the runner forgets them

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


def step_slot_bytes(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> int:
    """An upper bound on one encoded ``SchedulerOutput``, rounded up to a MiB: msgpack ints take at most
    5 bytes here; per request a block table, and 1 KiB for its id (three times: new, scheduled,
    finished), sampling parameters (at most ``MAX_STOP_TOKEN_IDS`` stop token ids, 640 bytes) and
    framing, plus the logits processors' lists at their caps (``sampling_lists_bytes``), plus the
    grammars of the at most ``MAX_GRAMMARS_PER_STEP`` new requests that carry one (a string header
    of 5 bytes each)."""
    per_request = 1024 + sampling_lists_bytes() + 5 * (-(-max_model_len // block_size))
    grammars = min(max_num_seqs, MAX_GRAMMARS_PER_STEP) * (MAX_GRAMMAR_BYTES + 5)
    bound = 5 * max_num_batched_tokens + max_num_seqs * per_request + grammars + 4096
    return -(-bound // (1 << 20)) * (1 << 20)


def sampling_lists_bytes() -> int:
    """The most one request's logits-processor fields add to its ``SamplingParams`` (msgpack): the
    logit_bias map (a 5-byte id and a 9-byte float64 an entry), allowed_token_ids, the bad words'
    sequences (a 3-byte array header each) and their tokens, each list with its header, and the
    four floats (9 bytes each)."""
    return (
        3
        + 14 * MAX_LOGIT_BIAS_ENTRIES
        + 3
        + 5 * MAX_ALLOWED_TOKEN_IDS
        + 3
        + 3 * MAX_BAD_WORDS
        + 5 * MAX_BAD_WORDS_TOKENS
        + 4 * 9
    )
