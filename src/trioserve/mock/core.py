"""The mock engine's pure core: instant prefill, one random token per running request per step.

No I/O and no clock of its own: the Trio shell (``mock.engine``) feeds it requests and aborts and calls
``step(now)`` on its step clock. This is seed 000's frontend-stress tool: its purpose is to produce
engine outputs at an exact, configurable rate so the API server's per-token cost can be measured.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from trioserve.protocol.messages import AddRequest, EngineStats, RequestOutput


@dataclass(slots=True)
class _MockRequest:
    add: AddRequest
    rng: random.Random | None  # per-request RNG when the request carries a seed, else the engine's
    stop_ids: frozenset[int]
    num_output: int = 0


@dataclass(slots=True)
class MockCore:
    vocab_size: int
    max_num_seqs: int
    max_model_len: int
    seed: int = 0
    waiting: deque[_MockRequest] = field(default_factory=deque)
    running: dict[str, _MockRequest] = field(default_factory=dict)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
        self.waiting.append(_MockRequest(add, rng, frozenset(stop_ids)))
        return None

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is None:
                # Rare (abort before the first step): a linear scan of the waiting queue is fine.
                self.waiting = deque(r for r in self.waiting if r.add.request_id != rid)

    def step(self) -> dict[int, list[RequestOutput]]:
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
            token = (req.rng or engine_rng).randrange(vocab)
            req.num_output += 1
            sp = req.add.sampling
            out = RequestOutput(rid, [token])
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

    def stats(self) -> EngineStats:
        return EngineStats(num_waiting=len(self.waiting), num_running=len(self.running))
