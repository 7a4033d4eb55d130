"""Where every socket between the API side and the engines listens (docs/remote_engines.md).

Rule. Engines all on this host (no handshake address, or an ``ipc://`` one): ``ipc://`` sockets in the
IPC folder, private to this user (the folder is ``0700``). A ``tcp://HOST:P`` handshake address (engines
on other hosts) puts every socket an engine connects to on ``HOST``, at the ports after ``P``:

| socket | port |
|---|---|
| the handshake (supervisor's, or the one API server's) | P |
| API server i's request ROUTER, output PULL | P + 1 + 2i, P + 2 + 2i |
| the supervisor's own (it is engine client N) | P + 1 + 2N, P + 2 + 2N |
| the DP coordinator's PULL (engines' load reports) | P + 3 + 2N |

The coordinator's PUB stays ``ipc://``: only the API servers, on this host, read it. ``HOST`` must be an
address engines can reach (not ``0.0.0.0``): Welcome hands these very addresses to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from trioserve.protocol.messages import ClientAddresses


@dataclass(frozen=True, slots=True)
class AddressLayout:
    ipc_dir: str
    handshake: str
    tcp_host: str | None = None  # engines on other hosts
    tcp_port: int = 0  # the handshake's port

    @classmethod
    def of(cls, handshake_address: str | None, ipc_dir: str) -> AddressLayout:
        """The layout for ``--handshake-address`` (None: this host only). ValueError for a TCP
        address without a usable host and port."""
        if handshake_address is None or not handshake_address.startswith("tcp://"):
            return cls(ipc_dir, handshake_address or f"ipc://{ipc_dir}/handshake")
        host, _, port = handshake_address.removeprefix("tcp://").rpartition(":")
        if not host or not port.isdigit() or host in ("*", "0.0.0.0", "[::]"):
            raise ValueError(
                f"--handshake-address {handshake_address}: use tcp://IP:PORT with an IP the engines "
                "can reach (the API side listens there, and tells engines to connect there)"
            )
        return cls(ipc_dir, handshake_address, host, int(port))

    def _tcp(self, offset: int) -> str:
        return f"tcp://{self.tcp_host}:{self.tcp_port + offset}"

    def client(self, index: int) -> ClientAddresses:
        """Engine client ``index``'s request ROUTER and output PULL."""
        if self.tcp_host is None:
            return ClientAddresses(
                f"ipc://{self.ipc_dir}/input_{index}", f"ipc://{self.ipc_dir}/output_{index}"
            )
        return ClientAddresses(self._tcp(1 + 2 * index), self._tcp(2 + 2 * index))

    def coordinator(self, api_server_count: int) -> tuple[str, str]:
        """The DP coordinator's PULL (engines connect) and PUB (this host's API servers connect)."""
        pub = f"ipc://{self.ipc_dir}/coordinator_out"
        if self.tcp_host is None:
            return f"ipc://{self.ipc_dir}/coordinator_in", pub
        return self._tcp(3 + 2 * api_server_count), pub
