"""The step ring's slot size: a worst-case step must always fit (a step that did not would fail the
engine; the ring never truncates). And how a worker and an engine core get their configuration: one
value each, built in one place."""

from __future__ import annotations

import msgspec
import pytest

from trioserve.config import EngineProcessConfig, override
from trioserve.engine.main import scheduler_config
from trioserve.engine.scheduler import SchedulerConfig
from trioserve.engine.worker_executor import WorkerExecutorConfig, worker_command
from trioserve.protocol.messages import MAX_GRAMMAR_BYTES, MAX_STOP_TOKEN_IDS, SamplingParams
from trioserve.protocol.ring_layout import RingHandle
from trioserve.protocol.step import NewRequestData, SchedulerOutput, step_slot_bytes
from trioserve.protocol.worker_messages import WorkerLaunch, WorkerStep

# The limits a worst-case step is built at: max_num_batched_tokens, max_num_seqs, max_model_len, block.
WORST = (2048, 256, 8192, 16)
BIG = 2**31 - 1  # 5 bytes in msgpack


def worst_case_step_frame(sampling: SamplingParams, grammars: int = 0) -> bytes:
    """One encoded step at ``WORST``: every request new, with the longest ids, whole block tables of
    big ids, ``sampling`` each (the first ``grammars`` of them with a grammar of the largest size
    too), and every request finished in the same step."""
    max_tokens, max_seqs, max_len, block = WORST
    tokens_each = max_tokens // max_seqs
    with_grammar = msgspec.structs.replace(sampling, grammar="g" * MAX_GRAMMAR_BYTES)
    new = [
        NewRequestData(
            request_id=f"chatcmpl-{i:024x}-{i}",  # as long as the API server makes them
            token_ids=[BIG] * tokens_each,
            num_computed_tokens=max_len - tokens_each,
            block_ids=[BIG] * (max_len // block),
            sampling=with_grammar if i < grammars else sampling,
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
    return msgspec.msgpack.encode(WorkerStep(step))


def test_worst_case_step_fits_the_slot() -> None:
    sampling = SamplingParams(
        max_tokens=WORST[2],
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        seed=2**62,
        stop_token_ids=[BIG] * MAX_STOP_TOKEN_IDS,
    )
    assert len(worst_case_step_frame(sampling)) <= step_slot_bytes(*WORST)


# ---- the worker's launch value and the engine-core process's configuration --------------------------


def test_the_worker_executor_config_comes_from_the_engine_process_sections() -> None:
    config = override(
        EngineProcessConfig(),
        model="/models/tiny",
        max_model_len=4096,
        block_size=8,
        num_gpu_blocks_override=100,
        max_num_batched_tokens=512,
        max_num_seqs=32,
        device="cpu",
        kv_cache_gib=0.5,
        worker_step_timeout=7.0,
        log_level="debug",
    )
    executor = WorkerExecutorConfig.from_config(config)
    assert (executor.model, executor.block_size, executor.num_blocks) == ("/models/tiny", 8, 100)
    assert executor.worker is config.worker
    assert executor.step_timeout == 7.0
    assert executor.step_slot_bytes == step_slot_bytes(512, 32, 4096, 8)
    assert executor.log_level == "debug"
    with pytest.raises(ValueError, match="model folder"):
        WorkerExecutorConfig.from_config(EngineProcessConfig())


def test_the_worker_gets_one_serialized_launch_value() -> None:
    config = override(EngineProcessConfig(), model="/models/tiny", kv_cache_gib=0.25, worker_threads=3)
    executor = WorkerExecutorConfig.from_config(config)
    steps = RingHandle("trioserve_s", 4, 1 << 20, 1, "reader", 0, (5,), (6,))
    results = RingHandle("trioserve_r", 4, 1 << 20, 1, "writer", -1, (7,), (8,))
    launch = executor.launch(steps, results)
    command = worker_command(launch)
    assert command[1:5] == ["-m", "trioserve", "worker", "--launch"] and len(command) == 6
    decoded = WorkerLaunch.from_json(command[5])
    assert decoded == launch
    assert (decoded.steps_ring, decoded.results_ring, decoded.worker.worker_threads) == (steps, results, 3)
    assert decoded.kv_cache_bytes == 1 << 28
    with pytest.raises(msgspec.ValidationError):  # a value from another version is refused, not guessed
        WorkerLaunch.from_json(command[5].replace('"rank"', '"rank_of_old"'))


def test_the_scheduler_config_comes_from_the_tree_in_one_place() -> None:
    config = override(
        EngineProcessConfig(),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        block_size=4,
        scheduling_policy="priority",
    )
    assert scheduler_config(config, num_blocks=32) == SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
        num_blocks=32,
        block_size=4,
        policy="priority",
    )
