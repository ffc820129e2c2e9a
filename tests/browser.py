"""A headless Chromium driven over the DevTools protocol (aiohttp's websocket client), for page tests.

`--dump-dom` snapshots a page once its load settles, which is too early for a page that streams
text from a long-running fetch; here a test navigates, evaluates JavaScript until a condition holds,
and takes a screenshot, like a person watching the page.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp


class Browser:
    def __init__(self, width: int = 900, height: int = 600):
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-")
        argv = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        argv += [f"--window-size={width},{height}", "--hide-scrollbars", "--remote-debugging-port=0"]
        argv += [f"--user-data-dir={self._profile.name}", "about:blank"]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self._ids = itertools.count(1)

    async def _endpoint(self) -> str:
        port_file = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as reply:
                targets = await reply.json(content_type=None)
        return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")

    async def watch(self, url: str, condition_js: str, timeout: float = 120.0) -> tuple[object, list, bytes]:
        """Open `url`, evaluate `condition_js` until it returns something truthy; returns that value,
        every value seen while polling (to see text stream in), and a PNG screenshot."""
        endpoint = await self._endpoint()
        async with aiohttp.ClientSession() as session, session.ws_connect(endpoint, max_msg_size=0) as ws:

            async def call(method: str, **params) -> dict:
                ident = next(self._ids)
                await ws.send_str(json.dumps({"id": ident, "method": method, "params": params}))
                while True:
                    message = json.loads((await ws.receive()).data)
                    if message.get("id") == ident:
                        if "error" in message:
                            raise RuntimeError(f"{method}: {message['error']}")
                        return message["result"]

            await call("Page.navigate", url=url)
            seen, deadline = [], time.monotonic() + timeout
            while True:
                result = await call("Runtime.evaluate", expression=condition_js, returnByValue=True)
                value = result["result"].get("value")
                seen.append(value)
                if value:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the page never satisfied {condition_js!r}; last value {value!r}")
                await asyncio.sleep(0.05)
            shot = await call("Page.captureScreenshot", format="png")
            return value, seen, base64.b64decode(shot["data"])

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._profile.cleanup()
