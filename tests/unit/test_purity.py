"""The unit tier's guard (tests/unit/conftest.py) refuses each way a test could start a process, a server or Ray."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import subprocess
import sys

import pytest
import ray


def test_a_subprocess_is_refused() -> None:
    with pytest.raises(RuntimeError, match="starts a subprocess"):
        subprocess.run([sys.executable, "-c", "pass"])


def test_a_multiprocessing_child_is_refused() -> None:
    with pytest.raises(RuntimeError, match="starts a multiprocessing process"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_server_socket_is_refused_and_a_socket_pair_is_not() -> None:
    with socket.socket() as server, pytest.raises(RuntimeError, match="binds a server socket"):
        server.bind(("127.0.0.1", 0))
    left, right = socket.socketpair()  # what an asyncio event loop opens for itself
    left.close(), right.close()
    assert asyncio.run(asyncio.sleep(0, result=1)) == 1


def test_ray_is_refused() -> None:
    with pytest.raises(RuntimeError, match="starts Ray"):
        ray.init()
