"""Server-sent events for a request's choices, as their generations produce text.

Every choice of the request pushes `(index, Delta)` items onto one queue and `(index, None)` when it
ends, so the choices stream interleaved, each chunk naming its choice (OpenAI's `index`). A chat opens
every choice with its role; a choice ends with its finish_reason; an error ends the whole stream
(OpenAI's error object, then [DONE]). With tools, a choice's text that may be a call is held back and
becomes `tool_calls` (or, failing to parse, content) when the choice ends (`client.api.tools`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from aiohttp import web

from llm_swarm.client.api.generation import GenerationJob
from llm_swarm.client.api.responses import Responder
from llm_swarm.client.api.tools import ToolCallStream

logger = logging.getLogger(__name__)


async def stream_choices(
    request: web.Request,
    jobs: list[GenerationJob],
    responder: Responder,
    include_usage: bool,
    error_for: Callable[[BaseException], tuple[int, dict]],
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    plan, by_index = responder.plan, {job.index: job for job in jobs}
    queue = jobs[0].deltas  # shared by the request's jobs
    held: dict[int, ToolCallStream] = {}
    if plan.tool_format is not None:
        held = {job.index: ToolCallStream(plan.tool_format, plan.opening) for job in jobs}

    async def send(payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    try:
        if responder.chat:
            for job in jobs:
                await send(responder.chunk(job.index, role=True))
        running, error = len(jobs), None
        while running:
            index, delta = await queue.get()
            job = by_index[index]
            if delta is not None:
                text = held[index].feed(delta.text) if index in held else delta.text
                if text or delta.logprobs:
                    await send(responder.chunk(index, text, delta.logprobs))
                continue
            running -= 1
            if job.error is not None:
                error = job.error
                break
            finish = job.result.finish_reason
            if index in held:
                text, calls = held[index].finish()
                if calls:
                    finish = "tool_calls"
                if text or calls:
                    await send(responder.chunk(index, text, tool_calls=calls))
            await send(responder.chunk(index, finish=finish))
        if error is not None:
            _status, payload = error_for(error)
            await send(payload)
        elif include_usage:
            await send(responder.usage_chunk(sum(job.result.completion_tokens for job in jobs)))
        await send("[DONE]")
        await response.write_eof()
    except (ConnectionResetError, asyncio.CancelledError) as gone:
        tokens = sum(job.result.completion_tokens for job in jobs)
        logger.info("a client left mid-stream after %d tokens: generation cancelled", tokens)
        for job in jobs:
            job.cancel()
        if isinstance(gone, asyncio.CancelledError):
            raise
    return response
