"""The engine client never sends a request on a keep-alive connection the server has closed.

SGLang serves HTTP with uvicorn, which closes a connection idle for 5 s. A client that keeps idle
connections longer can write its next request onto one the server has just closed: the request fails as
'connection lost' and the balancer counts a failure and retries, on a healthy engine. Here a real uvicorn
server (keep-alive 5 s) answers /generate; between two requests the client's event loop is blocked for
5.5 s, as a busy driver's can be, so the server's close is still unread when the next request is written.
That makes the race deterministic; a client that drops idle connections first (CLIENT_KEEPALIVE_S < 5)
opens a new connection instead. Takes ~6 s.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn

from megatron_rl.config import SamplingConfig
from megatron_rl.generator import client as engine_client
from megatron_rl.generator.balancer import EngineBalancer
from megatron_rl.generator.client import SGLangClient
from megatron_rl.rollout.interruption import Segment

SERVER_KEEPALIVE_S = 5
"""uvicorn's default, which SGLang servers we do not start ourselves keep."""
IDLE_S = 5.5

ANSWER = json.dumps(
    {
        "output_ids": [5],
        "meta_info": {
            "finish_reason": {"type": "length"},
            "output_token_logprobs": [[-0.5, 5, None]],
            "weight_versions": [{"start": 0, "end": 1, "version": "0"}],
        },
    }
).encode()


async def _generate_app(scope, receive, send):
    """A minimal ASGI app: every HTTP request gets one well-formed /generate answer."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": ANSWER})


class _Uvicorn:
    """uvicorn on a free local port, in a thread with its own event loop."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(_generate_app, timeout_keep_alive=SERVER_KEEPALIVE_S, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def test_a_request_after_the_servers_keepalive_neither_fails_nor_retries():
    async def main(url: str) -> tuple[Segment, Segment, EngineBalancer]:
        client = SGLangClient(url, timeout_s=30)
        balancer = EngineBalancer([client], SamplingConfig(), max_retries=1)
        try:
            first = await balancer([1], 1, [])
            time.sleep(IDLE_S)  # blocks the loop: the server's close at 5 s is not read before the next request
            return first, await balancer([1], 1, []), balancer
        finally:
            await client.close()

    with _Uvicorn() as url:
        first, second, balancer = asyncio.run(main(url))
    assert first == second == Segment([5], [-0.5], [0], "length")
    assert (balancer.failures, balancer.retries) == (0, 0)
    # What the blocked loop cannot show: a keep-alive between the server's and IDLE_S is as racy.
    assert engine_client.CLIENT_KEEPALIVE_S < SERVER_KEEPALIVE_S < IDLE_S
