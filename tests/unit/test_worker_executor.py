"""The step ring's slot size: a worst-case step must always fit (a step that did not would fail the
engine; the ring never truncates)."""

from __future__ import annotations

import msgspec

from trioserve.engine.scheduler import NewRequestData, SchedulerOutput
from trioserve.engine.worker_executor import step_slot_bytes
from trioserve.frontend.validate import MAX_STOP_TOKEN_IDS
from trioserve.protocol.messages import SamplingParams
from trioserve.protocol.worker_messages import WorkerStep


def test_worst_case_step_fits_the_slot() -> None:
    max_tokens, max_seqs, max_len, block = 2048, 256, 8192, 16
    tokens_each = max_tokens // max_seqs
    sampling = SamplingParams(
        max_tokens=max_len,
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        seed=2**62,
        stop_token_ids=[2**31 - 1] * MAX_STOP_TOKEN_IDS,
    )
    new = [
        NewRequestData(
            request_id=f"chatcmpl-{i:024x}-{i}",  # as long as the API server makes them
            token_ids=[2**31 - 1] * tokens_each,  # 5 bytes each in msgpack
            num_computed_tokens=max_len - tokens_each,
            block_ids=[2**31 - 1] * (max_len // block),
            sampling=sampling,
            samples=True,
            num_prompt_tokens=max_len - tokens_each,
            eos_token_id=151645,
        )
        for i in range(max_seqs)
    ]
    ids = [n.request_id for n in new]
    step = SchedulerOutput(
        step=2**40,
        new_requests=new,
        running_requests=[],
        num_scheduled_tokens={rid: tokens_each for rid in ids},
        total_num_scheduled_tokens=max_tokens,
        preempted_request_ids=[],
        finished_request_ids=ids,
    )
    frame = msgspec.msgpack.encode(WorkerStep(step))
    assert len(frame) <= step_slot_bytes(max_tokens, max_seqs, max_len, block)
