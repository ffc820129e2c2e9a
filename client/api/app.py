"""The OpenAI-compatible HTTP API (aiohttp): routes, admission, streaming and errors.

Every choice of a request (its prompts times `n`) runs in its own inference session through the swarm
client (its routing, scheduler use and failover), on a worker thread, so many streams proceed at once.
Admission is bounded in generations: at most `max_concurrent` run and `max_queued` wait; more get 429.
A client that goes away mid-stream cancels its generations, whose sessions then close and free the
servers' caches. Modules: `schema`/`chat_schema` (request bodies), `planning` (choices and bounds),
`generation` (one choice), `logprobs`, `tools`, `responses`/`streaming` (answers), `admission`.
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

from llm_swarm.client.api.chat_schema import ChatRequest
from llm_swarm.client.api.config import ApiConfig
from llm_swarm.client.api.errors import ApiError, error_body
from llm_swarm.client.api.generation import GenerationJob
from llm_swarm.client.api.generation_slots import GenerationSlots
from llm_swarm.client.api.logprobs import TokenTexts, install_hook
from llm_swarm.client.api.metrics import ApiMetrics
from llm_swarm.client.api.planning import RequestPlan, plan_chat, plan_completion
from llm_swarm.client.api.responses import Responder
from llm_swarm.client.api.schema import CompletionRequest, now
from llm_swarm.client.api.streaming import stream_choices
from llm_swarm.client.connection import SwarmUnavailable
from llm_swarm.swarm.errors import SwarmUserError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 2 * 1024 * 1024


class SwarmApi:
    """The routes of one API process over one client model."""

    def __init__(self, config: ApiConfig, model, tokenizer, assistant=None):
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.assistant = assistant  # every request drafts with it (`--assistant`); None: plain decoding
        self.metrics = ApiMetrics()
        # one worker per slot: admission never lets more generations run than there are workers
        self.executor = ThreadPoolExecutor(max_workers=config.max_concurrent, thread_name_prefix="generate")
        self.admission = GenerationSlots(config.max_concurrent, config.max_queued)
        self.texts = TokenTexts(tokenizer)
        self.vocab_size = getattr(model.config, "vocab_size", None) or len(tokenizer)
        install_hook(model)  # log-probabilities come from the logits of the model's own forwards
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
        html = resources.files("llm_swarm.client.api").joinpath("static/chat.html").read_text()
        return web.Response(text=html.replace("{{MODEL}}", self.config.model_name), content_type="text/html")

    async def health(self, _request: web.Request) -> web.Response:
        servers = len(self.model.backend.connection.roster.known)
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
        plan = plan_completion(body, self.tokenizer, self.config, self.vocab_size)
        responder = Responder(self.config.model_name, self.texts, plan, False, body.logprobs is not None)
        return await self._generate(request, body, plan, responder)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._authorize(request)
        body = self._parse(await self._json(request), ChatRequest)
        plan = plan_chat(body, self.tokenizer, self.config)
        responder = Responder(self.config.model_name, self.texts, plan, True, body.logprobs)
        return await self._generate(request, body, plan, responder)

    async def _generate(self, request, body, plan: RequestPlan, responder: Responder) -> web.StreamResponse:
        weight = len(plan.choices)
        self.admission.enter(weight)  # or 429
        self.metrics.in_flight.inc()
        try:
            async with self.admission.slots(weight):
                loop, queue = asyncio.get_running_loop(), asyncio.Queue()
                jobs = [
                    GenerationJob(
                        self.model,
                        self.tokenizer,
                        choice.prompt_ids,
                        choice.params,
                        loop,
                        self.assistant,
                        index=choice.index,
                        prompt_text=choice.prompt_text,
                        deltas=queue,
                    )
                    for choice in plan.choices
                ]
                started = time.monotonic()
                futures = [loop.run_in_executor(self.executor, job.run) for job in jobs]
                try:
                    if body.stream:
                        include_usage = body.stream_options is not None and body.stream_options.include_usage
                        response = await stream_choices(
                            request, jobs, responder, include_usage, self._error_for
                        )
                    else:
                        await asyncio.shield(asyncio.gather(*futures))
                        response = web.json_response(responder.whole([job.result for job in jobs]))
                finally:
                    for job in jobs:
                        job.cancel()  # a no-op when it finished; otherwise its session closes now
                    await asyncio.gather(*futures, return_exceptions=True)
                self.metrics.observe(request.path, plan.prompt_tokens, [job.result for job in jobs], started)
                return response
        finally:
            self.admission.leave(weight)
            self.metrics.in_flight.dec()

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
