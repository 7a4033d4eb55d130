"""Who may talk to whom over ZMQ between hosts: CURVE keys from one shared secret, and the ZAP check.

**What each kind of socket trusts** (docs/remote_engines.md):

- ``ipc://`` sockets trust the filesystem: they live in the supervisor's (or API server's) IPC folder,
  made ``0700`` by ``tempfile``, so only this user's processes can connect. Nothing else is checked.
- ``tcp://`` sockets (engines on other hosts: the handshake, every API server's request ROUTER and
  output PULL, the supervisor's own, the DP coordinator's PULL and PUB) are CURVE-encrypted and
  authenticated whenever ``--engine-secret`` (``TRIOSERVE_ENGINE_SECRET``) is set, and refused to be
  opened without it (``require_secret_for``): an unauthenticated TCP port would let whoever reaches
  it join as an engine and inject outputs.

**Keys.** Both sides derive the same keys from the secret (``Curve.from_secret``): a server key pair
(every binding side) and a client key pair (every connecting side), each secret key being
SHA-256(label, secret) and its public key computed from it. A peer must know the server's public key
to complete CURVE's handshake at all, and the server's ZAP handler (``serve_zap``) admits only the
client public key derived from the same secret: a wrong secret fails both ways. Traffic is encrypted
end to end with per-connection keys (CurveZMQ's forward secrecy).

**Process rule.** ``configure(curve)`` is called once at each process's start (before any socket);
from then on ``secure(sock, address, bind=...)`` — which ``TrioZmqSocket.create`` calls for every
socket — makes each ``tcp://`` socket a CURVE server (bind) or client (connect); ``ipc``/``inproc`` are
left alone. A process that binds ``tcp://`` sockets runs ``serve_zap`` on the same context first.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import trio
import zmq
from zmq.utils import z85

log = logging.getLogger("trioserve.transport")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27)
ZAP_DOMAIN = b"trioserve"
SECRET_ENV = "TRIOSERVE_ENGINE_SECRET"


class InsecureAddress(ValueError):
    """A ``tcp://`` engine address without an engine secret."""


@dataclass(frozen=True, slots=True)
class Curve:
    server_public: bytes  # z85, 40 bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> Curve:
        if not secret:
            raise ValueError("the engine secret must not be empty")

        def pair(label: bytes) -> tuple[bytes, bytes]:
            secret_key = z85.encode(hashlib.sha256(label + b"\0" + secret.encode()).digest())
            return zmq.curve_public(secret_key), secret_key

        server_public, server_secret = pair(b"trioserve curve server")
        client_public, client_secret = pair(b"trioserve curve client")
        return cls(server_public, server_secret, client_public, client_secret)


_curve: Curve | None = None


def configure(curve: Curve | None) -> None:
    """This process's CURVE keys (None: no secret; ``tcp://`` sockets are then refused)."""
    global _curve  # noqa: PLW0603  (one setting per process, made at its start, like logging's)
    _curve = curve


def configure_security(secret: str | None) -> None:
    """``configure`` from the engine secret setting (None: none)."""
    configure(Curve.from_secret(secret) if secret else None)


def configured() -> Curve | None:
    return _curve


def require_secret_for(address: str, secret: str | None = None) -> None:
    """Raises ``InsecureAddress`` for a ``tcp://`` address without a secret: ``secret`` when given
    (checking a configuration), else this process's (``configure``)."""
    if address.startswith("tcp://") and not secret and _curve is None:
        raise InsecureAddress(
            f"{address} is a TCP address: engines on other hosts need --engine-secret "
            f"(or {SECRET_ENV}) so that nobody else can join"
        )


def secure(sock: zmq.Socket[bytes], address: str, *, bind: bool) -> None:
    """Make ``sock`` a CURVE server (``bind``) or client, if ``address`` is ``tcp://`` (before
    bind/connect). Raises ``InsecureAddress`` for ``tcp://`` without a secret."""
    if not address.startswith("tcp://"):
        return
    require_secret_for(address)
    curve = _curve
    assert curve is not None
    if bind:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.client_secret)


def zap_verdict(frames: list[bytes], allowed: bytes) -> list[bytes]:
    """The reply to one ZAP request (RFC 27: version, request id, domain, address, identity, mechanism,
    credentials...): 200 for CURVE with the allowed client key (z85) in our domain, else 400. Pure."""
    version, request_id = [*frames, b"", b""][:2]
    if len(frames) < 6 or version != b"1.0":
        return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
    domain, address, mechanism = frames[2], frames[3], frames[5]
    key = frames[6] if len(frames) > 6 else b""
    if domain == ZAP_DOMAIN and mechanism == b"CURVE" and len(key) == 32 and z85.encode(key) == allowed:
        return [b"1.0", request_id, b"200", b"OK", b"engine", b""]
    log.warning("refused a connection from %s: wrong engine secret", address.decode(errors="replace"))
    return [b"1.0", request_id, b"400", b"wrong engine secret", b"", b""]


async def serve_zap(
    ctx: zmq.Context[zmq.Socket[bytes]], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """This process's ZAP handler: answers libzmq's authentication requests for every CURVE server
    socket on ``ctx`` (``started`` once bound: start it before binding any). Runs until cancelled."""
    from trioserve.transport.zmq_socket import TrioZmqSocket

    curve = _curve
    assert curve is not None, "serve_zap without configure()"
    rep = TrioZmqSocket.create(ctx, zmq.REP, bind=ZAP_ENDPOINT)
    try:
        task_status.started()
        while True:
            frames = await rep.recv_multipart()
            await rep.send_multipart(zap_verdict(frames, curve.client_public))
    finally:
        rep.close()
