"""The OpenAI-compatible HTTP API (aiohttp): routes, admission, streaming and errors.

Every request runs in its own inference session through the swarm client (its routing, scheduler
use and failover), on a worker thread, so many streams proceed at once. Admission is bounded:
at most `max_concurrent` generations run and `max_queued` wait; more get 429. A client that goes
away mid-stream cancels its generation, whose session then closes and frees the servers' caches.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from client.api.config import ApiConfig
from client.api.generation import GenerationJob, GenerationParams, GenerationResult
from client.api.metrics import ApiMetrics
from client.api.prompting import chat_prompt, completion_prompt
from client.api.schema import ChatRequest, CompletionRequest, error_body, new_id, now, usage
from client.connection import SwarmUnavailable
from swarm.errors import SwarmUserError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 2 * 1024 * 1024


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, code, param)


class SwarmApi:
    """The routes of one API process over one client model."""

    def __init__(self, config: ApiConfig, model, tokenizer, assistant=None):
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.assistant = assistant  # every request drafts with it (`--assistant`); None: plain decoding
        self.metrics = ApiMetrics()
        self.executor = ThreadPoolExecutor(max_workers=config.max_concurrent, thread_name_prefix="generate")
        self.slots = asyncio.Semaphore(config.max_concurrent)
        self.admitted = 0  # running or waiting for a slot
        self.created = now()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        app.router.add_get("/", self.page)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.scrape)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.on_shutdown.append(self._shutdown)
        return app

    # --- plain routes ---------------------------------------------------------------------------
    async def page(self, _request: web.Request) -> web.Response:
        html = resources.files("client.api").joinpath("static/chat.html").read_text()
        return web.Response(text=html.replace("{{MODEL}}", self.config.model_name), content_type="text/html")

    async def health(self, _request: web.Request) -> web.Response:
        servers = len(self.model.backend.connection.known_servers)
        return web.json_response({"status": "ok", "model": self.config.model_name, "known_servers": servers})

    async def scrape(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def models(self, request: web.Request) -> web.Response:
        self._authorize(request)
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "llm-swarm",
        }
        return web.json_response({"object": "list", "data": [card]})

    # --- generation routes ----------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request)
        body = self._parse(await self._json(request), CompletionRequest)
        prompt_ids = completion_prompt(self.tokenizer, body.prompt)
        return await self._generate(request, body, prompt_ids, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request)
        body = self._parse(await self._json(request), ChatRequest)
        prompt_ids = chat_prompt(self.tokenizer, body.messages)
        return await self._generate(request, body, prompt_ids, chat=True)

    async def _generate(self, request, body, prompt_ids: list[int], chat: bool) -> web.StreamResponse:
        params = self._params(body, len(prompt_ids))
        if self.admitted >= self.config.max_concurrent + self.config.max_queued:
            raise ApiError(
                429, "too many requests in flight; retry later", "rate_limit_exceeded", "rate_limit_exceeded"
            )
        self.admitted += 1
        self.metrics.in_flight.inc()
        try:
            async with self.slots:
                job = GenerationJob(
                    self.model, self.tokenizer, prompt_ids, params, asyncio.get_running_loop(), self.assistant
                )
                started = time.monotonic()
                future = asyncio.get_running_loop().run_in_executor(self.executor, job.run)
                try:
                    if body.stream:
                        response = await self._stream(request, job, body, chat, len(prompt_ids))
                    else:
                        await asyncio.shield(future)
                        response = web.json_response(self._whole(job.result, chat, len(prompt_ids)))
                finally:
                    job.cancel()  # a no-op when it finished; otherwise its session closes now
                    await asyncio.gather(future, return_exceptions=True)
                self.metrics.observe(request.path, len(prompt_ids), job.result, started)
                return response
        finally:
            self.admitted -= 1
            self.metrics.in_flight.dec()

    async def _stream(
        self, request, job: GenerationJob, body, chat: bool, prompt_tokens: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        ident, created = new_id("chatcmpl" if chat else "cmpl"), now()

        def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                content = (
                    {"role": "assistant", "content": ""}
                    if role
                    else ({} if delta is None else {"content": delta})
                )
                choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
                kind = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
                kind = "text_completion"
            return {
                "id": ident,
                "object": kind,
                "created": created,
                "model": self.config.model_name,
                "choices": [choice],
            }

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        try:
            if chat:
                await send(chunk(None, role=True))
            while (delta := await job.deltas.get()) is not None:
                await send(chunk(delta))
            error = job.error
            if error is not None:
                status, payload = self._error_for(error)
                await send(payload)
            else:
                await send(chunk(None, job.result.finish_reason))
                if body.stream_options is not None and body.stream_options.include_usage:
                    final = chunk(None)
                    final["choices"], final["usage"] = [], usage(prompt_tokens, job.result.completion_tokens)
                    await send(final)
            await send("[DONE]")
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError) as gone:
            logger.info(
                "a client left mid-stream after %d tokens: generation cancelled", job.result.completion_tokens
            )
            job.cancel()
            if isinstance(gone, asyncio.CancelledError):
                raise
        return response

    def _whole(self, result: GenerationResult, chat: bool, prompt_tokens: int) -> dict:
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None}
            kind, prefix = "chat.completion", "chatcmpl"
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None}
            kind, prefix = "text_completion", "cmpl"
        choice["finish_reason"] = result.finish_reason
        return {
            "id": new_id(prefix),
            "object": kind,
            "created": now(),
            "model": self.config.model_name,
            "choices": [choice],
            "usage": usage(prompt_tokens, result.completion_tokens),
        }

    # --- validation -------------------------------------------------------------------------------
    def _authorize(self, request: web.Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(
                401,
                "a valid API key is required (Authorization: Bearer ...)",
                "invalid_request_error",
                "invalid_api_key",
            )

    @staticmethod
    async def _json(request: web.Request) -> dict:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413, f"the request body exceeds {MAX_BODY_BYTES} bytes", "invalid_request_error"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON", "invalid_request_error") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_request_error")
        return body

    def _parse(self, body: dict, kind: type):
        try:
            parsed = kind.model_validate(body)
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or None
            raise ApiError(
                400,
                f"{param}: {first['msg']}" if param else first["msg"],
                "invalid_request_error",
                param=param,
            ) from None
        if parsed.model != self.config.model_name:
            raise ApiError(
                404,
                f"model {parsed.model!r} is not served here; /v1/models lists {self.config.model_name!r}",
                "invalid_request_error",
                "model_not_found",
                "model",
            )
        return parsed

    def _params(self, body, prompt_tokens: int) -> GenerationParams:
        config = self.config
        max_tokens = body.requested_tokens or config.default_max_tokens
        if max_tokens > config.max_tokens:
            raise ApiError(
                400,
                f"max_tokens {max_tokens} exceeds this server's limit of {config.max_tokens}",
                "invalid_request_error",
                param="max_tokens",
            )
        if prompt_tokens + max_tokens > config.max_context:
            raise ApiError(
                400,
                f"the prompt's {prompt_tokens} tokens plus max_tokens {max_tokens} exceed the context "
                f"of {config.max_context}",
                "invalid_request_error",
                param="max_tokens",
            )
        return GenerationParams(max_tokens, body.temperature, body.top_p, body.stop, body.seed)

    def _error_for(self, error: BaseException) -> tuple[int, dict]:
        if isinstance(error, SwarmUnavailable):
            return 503, error_body(
                f"the swarm cannot serve this request: {error}", "service_unavailable", "swarm_unavailable"
            )
        if isinstance(error, SwarmUserError):
            return 400, error_body(str(error), "invalid_request_error")
        logger.error("generation failed: %s: %s", type(error).__name__, error)
        return 500, error_body(f"generation failed: {type(error).__name__}", "server_error")

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as error:
            self.metrics.count(request.path, error.status)
            return web.json_response(error.body, status=error.status)
        except web.HTTPException as error:
            if error.status >= 400:
                self.metrics.count(request.path, error.status)
                return web.json_response(
                    error_body(error.reason, "invalid_request_error"), status=error.status
                )
            raise
        except Exception as error:  # from a non-streamed generation: the swarm, or our own bug
            status, body = self._error_for(error)
            self.metrics.count(request.path, status)
            return web.json_response(body, status=status)

    async def _shutdown(self, _app: web.Application) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
