"""Replica slots: the pure pick, the shared table by hand, across processes, then a state machine.

The state machine keeps a shadow of every (API server, replica) row and of each replica's last
assignment; every ``reserve`` must pick what ``choose`` picks from the shadow, and the table must equal
the shadow after every step.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

from trioserve.frontend.replica_slots import (
    DEFAULT_CAP,
    MAX_REPLICAS,
    ReplicaSlots,
    Reservation,
    choose,
)

SRC = Path(__file__).resolve().parents[2] / "src"

# ------------------------------------------------------------------------------------------ choose


def test_choose_takes_the_fewest_bytes() -> None:
    totals = [(1, 900, 1), (5, 100, 2), (0, 500, 0)]
    assert choose(totals, [True, True, True], 32) == 1  # bytes, not request count, decide


def test_choose_ties_go_to_the_least_recently_assigned_then_the_lowest_index() -> None:
    assert choose([(1, 100, 7), (1, 100, 3), (1, 100, 5)], [True] * 3, 32) == 1
    assert choose([(0, 0, 4), (0, 0, 0), (0, 0, 0)], [True] * 3, 32) == 1  # never assigned first
    assert choose([(0, 0, 0), (0, 0, 0)], [True, True], 32) == 0
    # The recency tie-break never beats bytes.
    assert choose([(1, 101, 0), (1, 100, 9)], [True, True], 32) == 1


def test_choose_skips_unready_and_full_replicas() -> None:
    totals = [(0, 0, 0), (3, 500, 1), (2, 900, 2)]
    assert choose(totals, [False, True, True], 3) == 2  # 0 not ready, 1 full
    assert choose(totals, [False, True, False], 3) is None  # the only ready one is full
    assert choose(totals, [False, False, False], 32) is None
    assert choose(totals, [True, True, True], 0) is None  # cap 0: nothing may start
    assert choose([], [], 32) is None


def test_choose_looks_only_at_replicas_both_sequences_cover() -> None:
    assert choose([(0, 50, 0), (0, 0, 0)], [True], 32) == 0
    assert choose([(0, 50, 0)], [True, True, True], 32) == 0


# ------------------------------------------------------------------------------------ hand-worked


def test_reserve_spreads_by_bytes_and_recency() -> None:
    slots = ReplicaSlots.create(None, api_servers=2, replicas=3)
    ready = [True, True, True]
    a = slots.reserve(0, ready, DEFAULT_CAP, 100)
    b = slots.reserve(1, ready, DEFAULT_CAP, 100)
    c = slots.reserve(0, ready, DEFAULT_CAP, 100)
    assert a is not None and b is not None and c is not None
    assert [a.replica, b.replica, c.replica] == [0, 1, 2]  # all tied on bytes: least recent first
    assert [slots.last_assigned(r) for r in range(3)] == [1, 2, 3]
    d = slots.reserve(1, ready, DEFAULT_CAP, 10)
    assert d is not None and d.replica == 0  # all at 100 bytes: replica 0 was assigned longest ago
    assert slots.totals(0) == (2, 110)
    assert slots.release(b)
    e = slots.reserve(0, ready, DEFAULT_CAP, 1)
    assert e is not None and e.replica == 1  # 0 bytes now
    slots.check_invariants()


def test_cap_counts_every_server_and_none_when_all_are_full() -> None:
    slots = ReplicaSlots.create(None, api_servers=3, replicas=2)
    got = [slots.reserve(i % 3, [True, True], 2, 1) for i in range(4)]
    assert all(r is not None for r in got)
    assert slots.totals(0) == (2, 2) and slots.totals(1) == (2, 2)
    assert slots.full(0, 2) and slots.full(1, 2) and not slots.full(0, 3)
    assert not slots.any_usable([True, True], 2)
    assert slots.reserve(2, [True, True], 2, 1) is None
    assert slots.all_totals() == [(2, 2, 3), (2, 2, 4)]  # the refusal changed nothing
    assert slots.any_usable([True, True], 3)
    assert slots.reserve(2, [False, False], 32, 1) is None  # none ready
    assert slots.reserve(2, [], 32, 1) is None
    slots.check_invariants()


def test_release_frees_the_slot_and_is_idempotent() -> None:
    slots = ReplicaSlots.create(None, api_servers=1, replicas=1)
    res = slots.reserve(0, [True], 1, 40)
    assert res is not None and slots.reserve(0, [True], 1, 1) is None
    assert slots.release(res)
    assert slots.totals(0) == (0, 0)
    assert not slots.release(res)  # second release: nothing changes
    assert slots.totals(0) == (0, 0)
    # A reservation this object never handed out (forged, or another object's) is refused.
    assert not slots.release(Reservation(0, 0, 40, res.token + 10_000))
    again = slots.reserve(0, [True], 1, 5)
    assert again is not None
    assert not slots.release(Reservation(0, 0, 999, again.token))  # the token, with other contents
    assert slots.totals(0) == (1, 5)
    slots.check_invariants()


def test_bytes_follow_reserve_and_release() -> None:
    slots = ReplicaSlots.create(None, api_servers=2, replicas=2)
    a = slots.reserve(0, [True, False], 32, 300)
    b = slots.reserve(1, [True, False], 32, 200)
    c = slots.reserve(1, [False, True], 32, 50)
    assert a is not None and b is not None and c is not None
    assert slots.totals(0) == (2, 500) and slots.totals(1) == (1, 50)
    d = slots.reserve(0, [True, True], 32, 7)
    assert d is not None and (d.api_index, d.replica, d.nbytes) == (0, 1, 7)  # 50 bytes < 500
    slots.release(a)
    assert slots.totals(0) == (1, 200)
    slots.release(b)
    assert slots.totals(0) == (0, 0)
    with pytest.raises(ValueError, match="nbytes"):
        slots.reserve(0, [True, True], 32, -1)
    with pytest.raises(ValueError, match="api_index"):
        slots.reserve(2, [True, True], 32, 1)


def test_forget_server_zeroes_only_that_servers_rows() -> None:
    slots = ReplicaSlots.create(None, api_servers=3, replicas=2)
    mine = [slots.reserve(0, [True, True], 32, 10) for _ in range(3)]
    theirs = [slots.reserve(1, [True, True], 32, 20) for _ in range(2)]
    other = slots.reserve(2, [True, True], 32, 5)
    assert all(r is not None for r in [*mine, *theirs, other])
    before = slots.all_totals()
    slots.forget_server(1)
    after = slots.all_totals()
    for r in range(2):  # exactly server 1's requests are gone, recency untouched
        gone = [x for x in theirs if x is not None and x.replica == r]
        assert after[r] == (before[r][0] - len(gone), before[r][1] - 20 * len(gone), before[r][2])
    assert sum(t[0] for t in after) == 4
    assert all(not slots.release(x) for x in theirs if x is not None)  # forgotten: no release
    assert sum(t[0] for t in slots.all_totals()) == 4
    slots.check_invariants()


def test_replica_count_grows_without_remapping_and_retired_replicas_drain() -> None:
    slots = ReplicaSlots.create(None, api_servers=1, replicas=1)
    ready = [True] * 4
    first = slots.reserve(0, ready, 32, 100)
    assert first is not None and first.replica == 0
    slots.set_replicas(3)
    assert slots.replicas == 3 and len(slots.all_totals()) == 3
    second = slots.reserve(0, ready, 32, 1)
    assert second is not None and second.replica == 1  # the new column, empty
    slots.set_replicas(1)  # retire 1 and 2: never picked again, but 1's request still releases
    third = slots.reserve(0, ready, 32, 1)
    assert third is not None and third.replica == 0
    assert slots.release(second) and slots.totals(1) == (0, 0)
    with pytest.raises(ValueError):
        slots.set_replicas(0)
    with pytest.raises(ValueError):
        slots.set_replicas(MAX_REPLICAS + 1)
    slots.check_invariants()


def test_create_refuses_bad_dims() -> None:
    with pytest.raises(ValueError, match="api_servers"):
        ReplicaSlots.create(None, api_servers=0, replicas=1)
    with pytest.raises(ValueError, match="replicas"):
        ReplicaSlots.create(None, api_servers=1, replicas=MAX_REPLICAS + 1)


# ---------------------------------------------------------------------------------- file-backed


def test_a_file_opened_twice_sees_the_same_counts(tmp_path: Path) -> None:
    path = str(tmp_path / "slots")
    owner = ReplicaSlots.create(path, api_servers=2, replicas=2)
    with owner, ReplicaSlots.open(path, api_servers=2) as one, ReplicaSlots.open(path) as two:
        a = one.reserve(0, [True, True], 32, 64)
        b = two.reserve(1, [True, True], 32, 8)
        assert a is not None and b is not None
        assert b.replica == 1  # two saw one's reservation on replica 0 (both at 0 bytes before)
        for view in (owner, one, two):
            assert view.totals(0) == (1, 64) and view.totals(1) == (1, 8)
        assert not two.release(a)  # only the object that reserved it gives it back
        assert one.release(a)
        assert owner.totals(0) == (0, 0)
        two.set_replicas(5)
        assert one.replicas == 5
        owner.forget_server(1)
        assert one.totals(1) == (0, 0)
        one.check_invariants()
    # Closed is closed, and closing again is harmless.
    owner.close()
    with pytest.raises(ValueError, match="closed"):
        owner.totals(0)


def test_create_replaces_an_old_table_and_old_mappings_keep_working(tmp_path: Path) -> None:
    path = str(tmp_path / "slots")
    old = ReplicaSlots.create(path, api_servers=1, replicas=1)
    assert old.reserve(0, [True], 32, 1) is not None
    new = ReplicaSlots.create(path, api_servers=4, replicas=2)
    assert ReplicaSlots.open(path).all_totals() == [(0, 0, 0), (0, 0, 0)]
    assert old.totals(0) == (1, 1)  # a different inode now; no SIGBUS, no mixing
    assert [p.name for p in tmp_path.iterdir()] == ["slots"]  # no temp file left
    old.close()
    new.close()


def test_header_mismatch_raises(tmp_path: Path) -> None:
    path = tmp_path / "slots"
    ReplicaSlots.create(str(path), api_servers=2, replicas=3).close()
    with pytest.raises(ValueError, match="expected 3"):
        ReplicaSlots.open(str(path), api_servers=3)
    good = path.read_bytes()

    def corrupt(offset: int, value: int) -> None:
        data = bytearray(good)
        data[offset : offset + 8] = value.to_bytes(8, sys.byteorder, signed=True)
        path.write_bytes(bytes(data))

    for slot, value, match in [
        (0, 12345, "magic"),
        (1, 99, "version"),
        (2, 3, "does not fit"),  # says 3 servers, sized for 2
        (3, 128, "columns"),
        (4, 0, "replicas"),
        (4, MAX_REPLICAS + 1, "replicas"),
    ]:
        corrupt(8 * slot, value)
        with pytest.raises(ValueError, match=match):
            ReplicaSlots.open(str(path))
    path.write_bytes(good[:100])
    with pytest.raises(ValueError, match="too short"):
        ReplicaSlots.open(str(path))
    path.write_bytes(good + b"\0" * 8)
    with pytest.raises(ValueError, match="does not fit"):
        ReplicaSlots.open(str(path))
    path.write_bytes(good)
    ReplicaSlots.open(str(path), api_servers=2).close()


_RACER = """
import sys, time
from pathlib import Path
from trioserve.frontend.replica_slots import ReplicaSlots
path, index, go = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
slots = ReplicaSlots.open(path, api_servers=4)
while not go.exists():
    time.sleep(0.0005)
# Phase 1: grab what there is and hold it.
held = [r for r in (slots.reserve(index, [True, True], 5, 1 + index) for _ in range(50)) if r]
# Phase 2, while the others may still grab: churn on a cap of 10 and never see a replica over it.
over = 0
for _ in range(1500):
    r = slots.reserve(index, [True, True], 10, 1)
    if r is not None:
        over += slots.totals(r.replica)[0] > 10
        slots.release(r)
print(len(held), over)
"""


def test_processes_racing_on_one_file_never_exceed_the_cap(tmp_path: Path) -> None:
    path = str(tmp_path / "slots")
    go = tmp_path / "go"
    slots = ReplicaSlots.create(path, api_servers=4, replicas=2)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, path, str(i), str(go)],
            stdout=subprocess.PIPE,
            text=True,
            env={"PYTHONPATH": str(SRC)},
        )
        for i in range(4)
    ]
    time.sleep(0.3)  # let them all reach the start line
    go.touch()
    results = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    wins = [int(held) for held, _ in results]
    assert sum(wins) == 10  # exactly the cap of both replicas, whoever won them
    assert [int(over) for _, over in results] == [0, 0, 0, 0]
    # The held ones are still counted (bytes 1 + index each); the churn gave back everything.
    assert slots.totals(0)[0] == 5 and slots.totals(1)[0] == 5
    assert slots.totals(0)[1] + slots.totals(1)[1] == sum(w * (1 + i) for i, w in enumerate(wins))
    slots.check_invariants()
    slots.close()


# --------------------------------------------------------------------------------- state machine

SERVERS = 3


class SlotsMachine(RuleBasedStateMachine):
    held = Bundle("held")

    @initialize(replicas=st.integers(1, 4), cap=st.integers(1, 4))
    def start(self, replicas: int, cap: int) -> None:
        self.slots = ReplicaSlots.create(None, api_servers=SERVERS, replicas=replicas)
        self.cap = cap
        self.rows: dict[tuple[int, int], tuple[int, int]] = {}
        self.last = [0] * MAX_REPLICAS
        self.seq = 0
        self.live: dict[int, int] = {}  # token -> API server, of reservations not given back

    def shadow_totals(self) -> list[tuple[int, int, int]]:
        out = []
        for r in range(self.slots.replicas):
            rows = [self.rows.get((s, r), (0, 0)) for s in range(SERVERS)]
            out.append((sum(x[0] for x in rows), sum(x[1] for x in rows), self.last[r]))
        return out

    @rule(
        target=held,
        api=st.integers(0, SERVERS - 1),
        ready=st.lists(st.booleans(), min_size=0, max_size=5),
        nbytes=st.integers(0, 1000),
    )
    def reserve(self, api: int, ready: list[bool], nbytes: int) -> Reservation | None:
        expected = choose(self.shadow_totals(), ready, self.cap)
        res = self.slots.reserve(api, ready, self.cap, nbytes)
        assert (None if res is None else res.replica) == expected
        if res is not None:
            n, b = self.rows.get((api, res.replica), (0, 0))
            self.rows[(api, res.replica)] = (n + 1, b + nbytes)
            self.seq += 1
            self.last[res.replica] = self.seq
            self.live[res.token] = api
        return res

    @rule(res=held)
    def release(self, res: Reservation | None) -> None:
        # Drawn without consuming: the same reservation may come back, and must then be refused.
        if res is None:
            return
        freed = self.slots.release(res)
        assert freed == (res.token in self.live)
        if freed:
            del self.live[res.token]
            n, b = self.rows[(res.api_index, res.replica)]
            self.rows[(res.api_index, res.replica)] = (n - 1, b - res.nbytes)

    @rule(api=st.integers(0, SERVERS - 1))
    def forget(self, api: int) -> None:
        self.slots.forget_server(api)
        self.rows = {k: v for k, v in self.rows.items() if k[0] != api}
        self.live = {t: s for t, s in self.live.items() if s != api}

    @rule(n=st.integers(1, 5))
    def resize(self, n: int) -> None:
        self.slots.set_replicas(n)

    @invariant()
    def table_matches_shadow(self) -> None:
        self.slots.check_invariants()
        assert self.slots.all_totals() == self.shadow_totals()
        for r in range(self.slots.replicas):
            assert self.slots.totals(r)[0] <= self.cap
        # The table never holds requests this side does not know of (so none can leak).
        assert sum(n for n, _ in self.rows.values()) == len(self.live)

    def teardown(self) -> None:
        if hasattr(self, "slots"):
            self.slots.close()


SlotsMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestSlotsMachine = SlotsMachine.TestCase
