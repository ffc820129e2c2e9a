"""The status web page, its JSON and Prometheus metrics over HTTP (aiohttp: no hand-written HTTP).

Served by the scheduler and by `swarm-health` on the asyncio loop they already run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from llm_swarm.scheduler.service.status_page import render_status_page

logger = logging.getLogger(__name__)

StatusSource = Callable[[], Awaitable[dict]]


def make_app(
    get_status: StatusSource, title: str, subtitle: str = "", metrics: Callable[[], bytes] | None = None
) -> web.Application:
    async def page(request: web.Request) -> web.Response:
        asked = request.query.get("page", "0")
        number = int(asked) if asked.isdigit() and len(asked) < 7 else 0  # anything else: the first page
        html = render_status_page(await get_status(), title, subtitle, page=number)
        return web.Response(text=html, content_type="text/html")

    async def api_status(_request: web.Request) -> web.Response:
        return web.Response(
            text=json.dumps(await get_status(), allow_nan=False), content_type="application/json"
        )

    async def scrape(_request: web.Request) -> web.Response:
        body = metrics() if metrics else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/", page)
    app.router.add_get("/api/status", api_status)
    if metrics is not None:
        app.router.add_get("/metrics", scrape)
    return app


async def start_web(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app`; returns the runner (to clean up) and the bound port (for port 0)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # aiohttp exposes no public accessor for port 0
    return runner, bound
