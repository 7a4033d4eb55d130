"""Folding one engine step's outputs into an earlier, still-undelivered step.

Used wherever a bounded hop is full and the policy is to keep memory bounded without stalling the
producer (the engine's output pump, the API server's step queue): the receiver then sees one step
with several tokens for a request instead of several steps. Invariants: per request, token ids stay in
order and none is lost; a finish reason, once set, stays; the newest stats and timestamp win.
"""

from __future__ import annotations

from trioserve.protocol.messages import EngineOutputs


def fold_outputs(into: EngineOutputs, newer: EngineOutputs) -> None:
    """Merge ``newer`` into ``into`` (mutated in place); both come from the same engine."""
    by_id = {out.request_id: out for out in into.outputs}
    for out in newer.outputs:
        held = by_id.get(out.request_id)
        if held is None:
            into.outputs.append(out)
            by_id[out.request_id] = out
            continue
        held.new_token_ids += out.new_token_ids
        if out.logprobs is not None:  # one per token: they stay side by side with the ids
            held.logprobs = [*(held.logprobs or ()), *out.logprobs]
        if held.prompt_logprobs is None:  # only a request's first output has them
            held.prompt_logprobs = out.prompt_logprobs
        if held.finish_reason is None:
            held.finish_reason = out.finish_reason
            held.stop_token_id = out.stop_token_id
            held.error = out.error
        if out.events:
            held.events = [*(held.events or ()), *out.events]
    into.step = newer.step
    into.timestamp = newer.timestamp
    into.stats = newer.stats
