"""API server side of the DP coordinator: the SUB socket's owner task, feeding the dispatch policy.

``follow_coordinator`` subscribes to the coordinator's PUB and hands each ``LoadSnapshot`` to
``policy.update`` and each ``KvEvents`` to ``policy.apply_kv``. Rules:

- **newest wins** for snapshots: after each wakeup it drains every message queued on the socket and
  applies only the last good snapshot (each replaces the previous one entirely, so older ones are
  worth nothing);
- **every one, in order** for KV events (each is a change to the policy's prefix index). A gap in
  their ``seq`` (this subscriber's queue overflowed) is counted (``kv_gaps``) and otherwise ignored:
  the index is a hint, and the coordinator's next re-sync (at most ``KV_RESYNC_INTERVAL`` + 1 s
  away) makes it exact again;
- **bad frames** are logged, counted and dropped; the link keeps going;
- it connects, not binds, so it may start before the coordinator (ZMQ reconnects), and a restarted
  coordinator is picked up the same way. The coordinator re-publishes at least once a second, so a
  fresh subscriber has the state within a second.

``LinkStats`` counts what arrived and when the last snapshot was applied (its age is a metric: a
coordinator silent for much longer than a second is gone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio
import zmq

from trioserve.frontend.dispatch import DispatchPolicy
from trioserve.protocol.codec import ProtocolError, coordinator_output_codec
from trioserve.protocol.messages import KvEvents, LoadSnapshot
from trioserve.transport.zmq_socket import TrioZmqSocket

log = logging.getLogger("trioserve.frontend")

# Messages queued before ZMQ drops news: snapshots (only the newest matters) and KV events (a re-sync
# is a burst of up to a few dozen per engine; the coordinator's PUB allows as many).
SUBSCRIBE_HWM = 256


@dataclass(slots=True)
class LinkStats:
    received: int = 0  # good snapshots read off the socket
    applied: int = 0  # handed to the policy (the rest were superseded in a drain)
    bad_frames: int = 0
    last_seq: int | None = None  # the last applied snapshot's ``seq``
    last_applied_at: float | None = None  # trio clock
    kv_received: int = 0  # KvEvents applied
    kv_gaps: int = 0  # times their seq jumped: some were lost (the index is stale until a re-sync)
    last_kv_seq: int | None = None

    def age(self, now: float) -> float | None:
        """Seconds since the last snapshot was applied (None: none yet)."""
        return None if self.last_applied_at is None else now - self.last_applied_at


async def follow_coordinator(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    policy: DispatchPolicy,
    *,
    stats: LinkStats | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Subscribes at ``address`` (``started`` once connected) and feeds ``policy`` until cancelled."""
    stats = LinkStats() if stats is None else stats
    codec = coordinator_output_codec()
    sub = TrioZmqSocket.create(ctx, zmq.SUB, rcvhwm=SUBSCRIBE_HWM)
    try:
        sub.raw.setsockopt(zmq.SUBSCRIBE, b"")
        sub.raw.connect(address)
        task_status.started()
        while True:
            frames: list[bytes] | None = await sub.recv_multipart()
            newest: LoadSnapshot | None = None
            while frames is not None:  # drain: only the last snapshot queued matters
                try:
                    message = codec.decode(frames[-1])
                except ProtocolError as exc:
                    stats.bad_frames += 1
                    log.warning("dropping coordinator frame: %s", exc)
                else:
                    if isinstance(message, KvEvents):
                        _apply_kv(policy, message, stats)
                    else:
                        newest = message
                        stats.received += 1
                frames = sub.try_recv_multipart()
            if newest is not None:
                policy.update(newest)
                stats.applied += 1
                stats.last_seq = newest.seq
                stats.last_applied_at = trio.current_time()
    finally:
        sub.close()


def _apply_kv(policy: DispatchPolicy, events: KvEvents, stats: LinkStats) -> None:
    # A seq that goes back is a restarted coordinator (it re-syncs everything within seconds): no gap.
    if stats.last_kv_seq is not None and events.seq > stats.last_kv_seq + 1:
        stats.kv_gaps += 1
        log.info(
            "missed KV events %d..%d; the prefix index is a hint until the next re-sync",
            stats.last_kv_seq + 1,
            events.seq - 1,
        )
    stats.last_kv_seq = events.seq
    stats.kv_received += 1
    policy.apply_kv(events)
