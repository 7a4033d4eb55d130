"""One typed encoder/decoder pair per direction; garbage frames become ``ProtocolError``."""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from trioserve.protocol.messages import (
    CoordinatorInput,
    CoordinatorOutput,
    EngineInput,
    EngineOutputMessage,
    HandshakeMessage,
    LoadReport,
    LoadSnapshot,
)

T = TypeVar("T")


class ProtocolError(Exception):
    """A frame that does not decode as the message union expected on this socket."""


class Codec(Generic[T]):
    """Encodes any message and decodes frames against one message union.

    The encoder reuses an internal buffer (``encode_into``) for senders that want it; decoding never
    raises anything but ``ProtocolError`` so socket owner tasks can log and drop a bad frame without
    dying.
    """

    __slots__ = ("_decoder", "_encoder", "name")

    def __init__(self, union: type[T] | object, name: str) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)
        self.name = name

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | bytearray | memoryview) -> T:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"bad {self.name} frame ({len(frame)} bytes): {exc}") from None


def handshake_codec() -> Codec[HandshakeMessage]:
    return Codec(HandshakeMessage, "handshake")


def engine_input_codec() -> Codec[EngineInput]:
    return Codec(EngineInput, "engine input")


def engine_output_codec() -> Codec[EngineOutputMessage]:
    return Codec(EngineOutputMessage, "engine output")


def load_report_codec() -> Codec[LoadReport]:
    return Codec(LoadReport, "load report")


def load_snapshot_codec() -> Codec[LoadSnapshot]:
    return Codec(LoadSnapshot, "load snapshot")


def coordinator_input_codec() -> Codec[CoordinatorInput]:
    """What the DP coordinator's PULL reads: engines' ``LoadReport``s and ``KvEvents``."""
    return Codec(CoordinatorInput, "coordinator input")


def coordinator_output_codec() -> Codec[CoordinatorOutput]:
    """What API servers read off the coordinator's PUB: ``LoadSnapshot``s and ``KvEvents``."""
    return Codec(CoordinatorOutput, "coordinator output")
