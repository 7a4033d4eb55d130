"""Starting trioserve's own child processes: the command line carries the child's part of the
configuration as one JSON value, and the secrets in it (API keys, the engine secret) travel in the
child's environment instead (``config.without_secrets``): ``/proc/PID/cmdline`` is readable by every
user of the host, ``/proc/PID/environ`` by the process's own user only."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import msgspec
import trio

from trioserve.config import SECRETS_ENV, encode, without_secrets


@dataclass(frozen=True, slots=True)
class ChildCommand:
    argv: list[str]
    env: dict[str, str]

    async def spawn(self, pass_fds: tuple[int, ...] = ()) -> trio.Process:
        return await trio.lowlevel.open_process(
            self.argv, stdin=subprocess.DEVNULL, env=self.env, pass_fds=pass_fds
        )


def child_command(subcommand: str, option: str, value: msgspec.Struct) -> ChildCommand:
    """``python -m trioserve SUBCOMMAND OPTION=JSON``, ``value``'s secrets in the environment."""
    public, secrets = without_secrets(value)
    return ChildCommand(
        [sys.executable, "-m", "trioserve", subcommand, f"{option}={encode(public)}"],
        dict(os.environ, **{SECRETS_ENV: secrets}),
    )
