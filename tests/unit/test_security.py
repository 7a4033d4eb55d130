"""The engine secret: CURVE keys derived from it, the ZAP verdict, which sockets it covers, and the
rule that secrets never reach a child's command line."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
from zmq.utils import z85

from trioserve.config import ServeConfig, override, with_secrets, without_secrets
from trioserve.launch.addresses import AddressLayout
from trioserve.launch.children import child_command
from trioserve.transport import security
from trioserve.transport.security import Curve, InsecureAddress, zap_verdict


@pytest.fixture
def no_curve() -> Iterator[None]:
    yield
    security.configure(None)


def test_keys_are_derived_from_the_secret_and_differ_between_secrets() -> None:
    a, b, c = Curve.from_secret("s1"), Curve.from_secret("s1"), Curve.from_secret("s2")
    assert a == b
    assert a.server_public != c.server_public and a.client_public != c.client_public
    assert a.server_public != a.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public
    with pytest.raises(ValueError, match="empty"):
        Curve.from_secret("")


def zap_request(key: bytes, *, domain: bytes = b"trioserve", mechanism: bytes = b"CURVE") -> list[bytes]:
    return [b"1.0", b"7", domain, b"10.0.0.2", b"", mechanism, z85.decode(key)]


def test_zap_admits_only_the_client_key_of_the_same_secret() -> None:
    good, bad = Curve.from_secret("right"), Curve.from_secret("wrong")
    assert zap_verdict(zap_request(good.client_public), good.client_public)[2] == b"200"
    assert zap_verdict(zap_request(bad.client_public), good.client_public)[2] == b"400"
    assert zap_verdict(zap_request(good.client_public, domain=b"x"), good.client_public)[2] == b"400"
    assert zap_verdict(zap_request(good.client_public, mechanism=b"NULL"), good.client_public)[2] == b"400"
    reply = zap_verdict([b"2.0", b"9"], good.client_public)
    assert reply[:3] == [b"1.0", b"9", b"500"]


def test_tcp_sockets_need_the_secret_and_get_curve(no_curve: None) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(InsecureAddress, match="--engine-secret"):
            security.secure(sock, "tcp://127.0.0.1:5555", bind=True)
        security.secure(sock, "ipc:///tmp/x", bind=True)  # ipc: nothing to do, no secret needed
        assert sock.getsockopt(zmq.CURVE_SERVER) == 0
        security.configure(Curve.from_secret("s"))
        security.secure(sock, "tcp://127.0.0.1:5555", bind=True)
        assert sock.getsockopt(zmq.CURVE_SERVER) == 1
        assert sock.getsockopt(zmq.ZAP_DOMAIN) == b"trioserve"
    finally:
        sock.close(linger=0)


def test_curve_peers_with_the_same_secret_talk_and_a_wrong_secret_does_not(no_curve: None) -> None:
    """Real sockets over TCP on 127.0.0.1 (no ZAP handler here: the server key alone refuses the
    wrong secret, which cannot complete CURVE's handshake)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        security.configure(Curve.from_secret("right"))
        server = ctx.socket(zmq.PULL)
        security.secure(server, "tcp://127.0.0.1:0", bind=True)
        server.bind("tcp://127.0.0.1:*")
        address = server.getsockopt_string(zmq.LAST_ENDPOINT)
        good = ctx.socket(zmq.PUSH)
        security.secure(good, address, bind=False)
        good.connect(address)
        security.configure(Curve.from_secret("wrong"))
        bad = ctx.socket(zmq.PUSH)
        security.secure(bad, address, bind=False)
        bad.connect(address)
        bad.send(b"from the wrong secret", zmq.NOBLOCK)
        good.send(b"from the right secret")
        assert server.poll(5000)
        assert server.recv() == b"from the right secret"
        assert not server.poll(500)  # the other never arrives
        for sock in (server, good, bad):
            sock.close(linger=0)
    finally:
        ctx.term()


def test_secrets_never_reach_a_childs_command_line() -> None:
    config = override(ServeConfig(), api_key=("key-1",), engine_secret="hush")
    public, secrets = without_secrets(config)
    assert public.frontend.access.api_key == () and public.engine.engine_secret is None
    assert with_secrets(public, secrets) == config
    command = child_command("engine-core", "--config-json", config.engine_process("ipc:///x"))
    assert not any("hush" in arg for arg in command.argv)
    assert "hush" in command.env["TRIOSERVE_CHILD_SECRETS"]


def test_the_tcp_address_layout() -> None:
    layout = AddressLayout.of("tcp://10.0.0.1:7000", "/tmp/d")
    assert layout.client(0).input_address == "tcp://10.0.0.1:7001"
    assert layout.client(1).output_address == "tcp://10.0.0.1:7004"
    assert layout.coordinator(2) == ("tcp://10.0.0.1:7007", "ipc:///tmp/d/coordinator_out")
    assert AddressLayout.of(None, "/tmp/d").client(0).input_address == "ipc:///tmp/d/input_0"
    for bad in ("tcp://0.0.0.0:7000", "tcp://10.0.0.1", "tcp://:7000"):
        with pytest.raises(ValueError, match="IP the engines"):
            AddressLayout.of(bad, "/tmp/d")
