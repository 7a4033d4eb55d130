"""Engine core ↔ worker messages (design §8): steps go out on the shared-memory ring to every worker,
results come back from the output rank only, on a second ring. Same rules as ``messages.py``: tagged
msgpack arrays, append-only fields with defaults, no pickle."""

from __future__ import annotations

import msgspec

from trioserve.engine.scheduler import SchedulerOutput
from trioserve.protocol.codec import Codec


class _Wire(msgspec.Struct, array_like=True, gc=False):
    pass


class WorkerStep(_Wire, tag="step"):
    step: SchedulerOutput


class WorkerShutdown(_Wire, tag="shutdown"):
    pass


class WorkerReady(_Wire, tag="ready"):
    rank: int
    pid: int
    load_seconds: float
    device: str
    num_blocks: int  # KV blocks the worker allocated: the engine core's ledger gets exactly these


class StepResult(_Wire, tag="result"):
    step: int  # the SchedulerOutput.step it answers
    sampled: dict[str, list[int]]


class WorkerFailed(_Wire, tag="failed"):
    """A worker that cannot go on says why before it exits (the engine turns this into request errors)."""

    rank: int
    error: str


WorkerInput = WorkerStep | WorkerShutdown
WorkerOutput = WorkerReady | StepResult | WorkerFailed


def worker_input_codec() -> Codec[WorkerInput]:
    return Codec(WorkerInput, "worker input")


def worker_output_codec() -> Codec[WorkerOutput]:
    return Codec(WorkerOutput, "worker output")
