"""Splitting a batch of KV events into bounded messages: shared by the engines (``engine/kv_events.py``)
and the DP coordinator (``coordinator/core.py``), which batch the same way."""

from __future__ import annotations

from collections.abc import Sequence

from trioserve.protocol.messages import MAX_KV_EVENT_KEYS, KvEvents


def chunk_kv_events(
    engine_index: int,
    stored: Sequence[int],
    removed: Sequence[int],
    *,
    cleared: bool,
    first_seq: int,
    max_keys: int = MAX_KV_EVENT_KEYS,
) -> list[KvEvents]:
    """``stored`` and ``removed`` as messages of at most ``max_keys`` keys each (removals first),
    ``cleared`` on the first only, numbered from ``first_seq``. No keys: no message, except that a
    ``cleared`` batch is always one (it empties the receiver's entry)."""
    if max_keys < 1:
        raise ValueError(f"need max_keys >= 1, got {max_keys}")
    messages: list[KvEvents] = []
    s = r = 0
    while s < len(stored) or r < len(removed) or (cleared and not messages):
        take_r = list(removed[r : r + max_keys])
        r += len(take_r)
        take_s = list(stored[s : s + max_keys - len(take_r)])
        s += len(take_s)
        messages.append(
            KvEvents(engine_index, take_s, take_r, cleared and not messages, first_seq + len(messages))
        )
    return messages
