"""Wire protocol: every message round-trips, old decoders read new messages, garbage is rejected."""

from __future__ import annotations

import msgspec
import pytest
import trio
import trio.lowlevel
import zmq

from trioserve.protocol.codec import ProtocolError, engine_input_codec, engine_output_codec, handshake_codec
from trioserve.protocol.messages import (
    AbortRequests,
    AddRequest,
    ClientAddresses,
    EngineDead,
    EngineHello,
    EngineOutputs,
    EngineReady,
    EngineStats,
    RequestEvent,
    RequestOutput,
    SamplingParams,
    ShutdownEngine,
    Welcome,
)
from trioserve.transport.zmq_socket import TrioZmqSocket

SAMPLES = [
    (handshake_codec, EngineHello(engine_index=1, pid=42)),
    (handshake_codec, Welcome([ClientAddresses("ipc:///tmp/a", "ipc:///tmp/b")])),
    (handshake_codec, EngineReady(0, 42, "mock", 8192, 256, 32000, num_kv_blocks=10, block_size=16)),
    (
        engine_input_codec,
        AddRequest(
            "r-0",
            [1, 2, 3],
            SamplingParams(5, 0.5, 0.9, 40, seed=7, stop_token_ids=[9], ignore_eos=True, min_tokens=1),
            1.5,
            client_index=1,
            priority=-2,
            cache_salt="s",
            eos_token_id=151645,
        ),
    ),
    (engine_input_codec, AbortRequests(["a", "b"])),
    (engine_input_codec, ShutdownEngine("bye")),
    (
        engine_output_codec,
        EngineOutputs(
            0,
            3,
            2.5,
            [
                RequestOutput("r-0", [5]),
                RequestOutput(
                    "r-1",
                    [6, 7],
                    finish_reason="stop",
                    stop_token_id=7,
                    num_cached_tokens=16,
                    events=[RequestEvent("queued", 1.0), RequestEvent("scheduled", 1.1)],
                ),
                RequestOutput("r-2", [], finish_reason="error", error="does not fit"),
            ],
            EngineStats(1, 2, 0.5, 3, 100, 40),
        ),
    ),
    (engine_output_codec, EngineDead(0, "boom")),
]


@pytest.mark.parametrize(("codec", "message"), SAMPLES, ids=lambda v: type(v).__name__)
def test_every_message_round_trips(codec: object, message: msgspec.Struct) -> None:
    c = codec()  # type: ignore[operator]
    assert c.decode(c.encode(message)) == message


def test_a_message_is_only_accepted_on_its_own_socket() -> None:
    frame = engine_input_codec().encode(AbortRequests(["x"]))
    with pytest.raises(ProtocolError):
        engine_output_codec().decode(frame)


class _OldRequestOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]


class _NewRequestOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    appended: int | None = None  # a field a newer release added at the end


def test_older_decoder_reads_newer_message_with_appended_field() -> None:
    new = msgspec.msgpack.encode(_NewRequestOutput("r", [1], appended=99))
    assert msgspec.msgpack.decode(new, type=_OldRequestOutput) == _OldRequestOutput("r", [1])
    # And the other way round: a newer decoder fills the missing field with its default.
    old = msgspec.msgpack.encode(_OldRequestOutput("r", [1]))
    assert msgspec.msgpack.decode(old, type=_NewRequestOutput) == _NewRequestOutput("r", [1], None)


def test_real_message_gains_a_trailing_field() -> None:
    # An AddRequest frame from a newer sender with one more trailing element still decodes.
    frame = msgspec.msgpack.decode(engine_input_codec().encode(AbortRequests(["a"])))
    newer = msgspec.msgpack.encode([*frame, "future"])
    assert engine_input_codec().decode(newer) == AbortRequests(["a"])


@pytest.mark.parametrize(
    "frame",
    [b"", b"\xff\xff", b"\x93garbage", msgspec.msgpack.encode(["nope", 1]), msgspec.msgpack.encode({"a": 1})],
)
def test_garbage_frames_raise_protocol_error(frame: bytes) -> None:
    for make in (handshake_codec, engine_input_codec, engine_output_codec):
        with pytest.raises(ProtocolError):
            make().decode(frame)


async def test_zmq_socket_drains_and_waits_under_trio() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = TrioZmqSocket.create(ctx, zmq.PULL, bind="inproc://unit-drain")
    push = TrioZmqSocket.create(ctx, zmq.PUSH, connect="inproc://unit-drain")
    try:
        got: list[bytes] = []

        async def receive() -> None:
            while len(got) < 50:
                got.append((await pull.recv_multipart())[0])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            for i in range(50):
                await push.send_multipart([b"%d" % i])
                if i % 7 == 0:
                    await trio.lowlevel.checkpoint()  # interleave bursts and waits
        assert got == [b"%d" % i for i in range(50)]
        assert pull.try_recv_multipart() is None
    finally:
        pull.close()
        push.close()
        ctx.term()
