"""TCP ports for listeners that another process binds later: an SGLang server's, a trainer's rendezvous store.

A port found by binding port 0 comes from the kernel's ephemeral range, the one every other process's bind(0) and
outgoing connection draws from too; released by the process that found it, it can be taken before the listener it
was meant for binds it. Ports handed out here lie below that range, where only an explicit bind takes them.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_FLOOR = 20000
"""(ours) The lowest port `free_port` hands out: above Ray's worker ports (10002-19999 by default)."""

_handed_out: set[int] = set()
"""Ports this process handed out, never handed out twice: two listeners started together must not share one."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range: every bind to port 0 and every outgoing connection draws from it."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (all interfaces for "") for a listener that another process binds later.

    Below the ephemeral range where there is room: in the seconds between its release here and the listener's
    bind (an SGLang server's after its imports and model load, a trainer rank's rendezvous store after torch's),
    a port from that range could be taken by another process's rendezvous store, gloo listener or outgoing
    connection. A server then died with "address already in use" while its warm-up request hung on the other
    process's socket; a trainer rank's store failed to listen (EADDRINUSE). Below the range only an explicit bind
    can take it. (SGLang picks its own NCCL port the same way, `sglang.srt.utils.network.
    get_free_port_below_ephemeral`.)
    """
    below = range(PORT_FLOOR, ephemeral_range()[0])  # empty when the range starts at the floor or under it
    for port in random.sample(below, min(64, len(below))):
        if port not in _handed_out and port_is_free(host, port, reuse=False):
            _handed_out.add(port)
            return port
    while True:  # no room below the range (a kernel configured to hand out every port): the kernel's pick
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def port_is_free(host: str, port: int, reuse: bool = True) -> bool:
    """Whether a listener can bind `port` now (`reuse`: as one with SO_REUSEADDR, as uvicorn binds, which may
    take a port whose last connections are still in TIME_WAIT)."""
    with socket.socket() as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
