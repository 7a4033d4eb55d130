"""The shared-memory ring's layout, pure: geometry, the checks on values read from the segment, the
handle (no segment, no pipes; the endpoints' tests are in test_shm_ring.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trioserve.protocol import ring_layout
from trioserve.protocol.ring_layout import (
    CorruptRing,
    RingGeometry,
    RingHandle,
    check_length,
    slot_holds,
    writable_until,
)


def test_geometry_aligns_every_area_to_a_cache_line() -> None:
    g = RingGeometry(num_slots=3, slot_size=100, num_readers=2)
    assert g.slot_stride == 128  # 16-byte slot header + 100, rounded up to 64
    assert g.reader_offset(0) == 64
    assert g.reader_offset(1) == 128
    assert g.slots_offset == 192
    assert g.size == 192 + 3 * 128
    assert RingGeometry(1, 48, 1).slot_stride == 64  # 16 + 48 fits one line exactly


def test_message_numbers_wrap_over_the_slots() -> None:
    g = RingGeometry(num_slots=3, slot_size=100, num_readers=1)
    offsets = [g.slot_offset(n) for n in range(1, 8)]
    assert offsets == [128, 256, 384, 128, 256, 384, 128]
    assert g.slot_offset(3 * 10**12 + 2) == 256
    with pytest.raises(ValueError, match="start at 1"):
        g.slot_offset(0)
    with pytest.raises(IndexError):
        g.reader_offset(1)


@pytest.mark.parametrize(
    ("num_slots", "slot_size", "num_readers"), [(0, 8, 1), (4, 0, 1), (4, 2**32, 1), (4, 8, 0), (4, 8, 257)]
)
def test_geometry_rejects_impossible_shapes(num_slots: int, slot_size: int, num_readers: int) -> None:
    with pytest.raises(ValueError):
        RingGeometry(num_slots, slot_size, num_readers)


def test_a_slot_holds_the_wanted_message_or_the_previous_lap() -> None:
    assert slot_holds(7, 7, 4)
    assert not slot_holds(3, 7, 4)  # one lap earlier: 7 is not published yet
    assert not slot_holds(0, 2, 4)  # first lap: never written
    for seen in (1, 2, 4, 5, 6, 8, 11, 2**64 - 1):
        with pytest.raises(CorruptRing, match="sequence number"):
            slot_holds(seen, 7, 4)
    with pytest.raises(CorruptRing):
        slot_holds(1, 2, 4)  # on the first lap only 0 or 2 are possible


def test_lengths_beyond_the_slot_are_corruption() -> None:
    assert check_length(256, 256) == 256
    with pytest.raises(CorruptRing, match="exceeds the slot size"):
        check_length(257, 256)


def test_the_slowest_live_reader_bounds_the_writer() -> None:
    assert writable_until([10, 7, 9], written=10, num_slots=4) == 11
    assert writable_until([10], written=10, num_slots=4) == 14
    assert writable_until([], written=10, num_slots=4) > 2**63  # nobody to wait for
    with pytest.raises(CorruptRing, match="acknowledged message 11"):
        writable_until([11], written=10, num_slots=4)


def test_handle_round_trips_as_json() -> None:
    handle = RingHandle("trioserve_x", 8, 1024, 3, "reader", 2, (7,), (9,))
    text = handle.to_json()
    assert RingHandle.from_json(text) == handle
    assert handle.fds == (7, 9)
    assert handle.geometry == RingGeometry(8, 1024, 3)


def test_fields_are_aligned_and_fit_their_area_as_documented() -> None:
    """The offsets are the docstring's table: in its order, each field naturally aligned ("Memory ordering":
    one aligned ``mov`` per load or store), none overlapping, inside its line."""
    areas = {
        ring_layout.HEADER_SIZE: [
            (ring_layout.H_MAGIC, 8),
            (ring_layout.H_NUM_SLOTS, 4),
            (ring_layout.H_SLOT_SIZE, 4),
            (ring_layout.H_NUM_READERS, 4),
            (ring_layout.H_WRITER_PID, 4),
            (ring_layout.H_WRITER_STATE, 4),
            (ring_layout.H_FLAGS, 4),
            (ring_layout.H_WRITER_WANTS, 8),
        ],
        ring_layout.READER_AREA: [
            (ring_layout.R_ACK, 8),
            (ring_layout.R_WANTS, 8),
            (ring_layout.R_PID, 4),
            (ring_layout.R_STATE, 4),
        ],
        ring_layout.SLOT_HEADER: [(ring_layout.S_SEQ, 8), (ring_layout.S_LENGTH, 4)],
    }
    for size, fields in areas.items():
        end = 0
        for offset, width in fields:
            assert offset % width == 0
            assert offset >= end
            end = offset + width
        assert end <= size
    assert ring_layout.SLOT_HEADER % 8 == 0  # the payload starts 8-aligned
    assert ring_layout.MAX_SLOT_SIZE + ring_layout.LINE <= 2**32 - 1  # a length fits its u32
    assert len(set(ring_layout.STATES)) == 3


def test_the_layout_imports_without_trio_zmq_or_torch() -> None:
    blocked = "import sys\nfor name in ('trio', 'zmq', 'torch'):\n    sys.modules[name] = None\n"
    code = blocked + "import trioserve.protocol.ring_layout\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
