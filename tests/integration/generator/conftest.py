"""Servers shared by the generator tests."""

from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.Response]]


@pytest.fixture
def generate_server() -> Callable[[Handler], Awaitable[tuple[web.AppRunner, str]]]:
    """Start a local HTTP server (no SGLang) whose POST /generate is `handler`: returns its runner (to clean up)
    and base URL, on a free port of 127.0.0.1."""

    async def serve(handler: Handler) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/generate", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

    return serve
