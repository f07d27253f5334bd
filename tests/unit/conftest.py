"""The unit tier is pure: a unit test starts no process, no server and no Ray; tests/integration holds those.

Each entry point is refused during a unit test with the reason, so a test that needs one fails here (and moves to
tests/integration/<area>/) instead of slowing the tier down: subprocesses, multiprocessing children (the reward
workers, torch's spawn), Ray (its start is processes too, refused by name so the message says so) and a server
socket (aiohttp's test servers; a client's outgoing connection binds nothing).
"""

from __future__ import annotations

import multiprocessing.process
import socket
import subprocess
from collections.abc import Callable

# megatron-core computes its version by running `git rev-parse` when it is first imported (package_info.py): that
# import happens here, once, at collection, not inside whichever unit test imports megatron first.
import megatron.core  # noqa: F401
import pytest


class StartsProcessesOrServers(RuntimeError):
    """A unit test started a process or a server."""


def _refuse(what: str) -> Callable[..., None]:
    def refused(*args: object, **kwargs: object) -> None:
        raise StartsProcessesOrServers(f"a unit test {what}: it belongs in tests/integration/<area>/")

    return refused


@pytest.fixture(autouse=True)
def _pure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("starts a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("starts a multiprocessing process"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("binds a server socket"))
    try:
        import ray
    except ImportError:
        return
    monkeypatch.setattr(ray, "init", _refuse("starts Ray"))
