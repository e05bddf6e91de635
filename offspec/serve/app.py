"""The OpenAI-compatible HTTP app (FastAPI): /v1/chat/completions, /v1/completions, /v1/models, /health.

`create_app(generator, config)` puts one `EngineQueue` in front of the generator. Every request writes one
JSON log line on the `offspec.serve` logger (id, status, tokens, tokens/s, tokens per pass, ...). Errors
are answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}. A chat reply of a reasoning model
(the generator's `reasoning` format) has its reasoning in `reasoning_content` (offspec/serve/reply.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from offspec.errors import OffspecError
from offspec.types import GenerationResult, StreamEvent
from offspec.util.reasoning import Split, held_from_start

from .config import ServeConfig
from .protocol import APIError, GenerationRequest, parse_chat, parse_completion
from .queue import EngineQueue, Job, QueueFull, ShuttingDown
from .reply import ReplyStream, whole_reply
from .responses import Shape, finish_reason
from .tools import ToolPlan, ToolStream, plan

log = logging.getLogger("offspec.serve")


class RequestLog:
    """The one structured log line of a request: a JSON object, written once, whatever happens."""

    def __init__(self, request: Request):
        self.started = time.monotonic()
        self.fields: dict = {"id": f"req-{uuid.uuid4().hex[:24]}", "method": request.method,
                             "path": request.url.path}
        self.written = False

    def write(self, status: int, **fields) -> None:
        if self.written:
            return
        self.written = True
        self.fields.update(status=status, **{k: v for k, v in fields.items() if v is not None})
        self.fields["ms"] = round(1000 * (time.monotonic() - self.started), 1)
        log.info(json.dumps(self.fields, ensure_ascii=False))


def _request_log(request: Request) -> RequestLog:
    if not hasattr(request.state, "log"):
        request.state.log = RequestLog(request)
    return request.state.log


def _result_fields(result: GenerationResult, job: Job) -> dict:
    return dict(prompt_tokens=result.prompt_tokens, cached_tokens=result.reused_prompt_tokens,
                completion_tokens=len(result.token_ids), passes=result.n_passes,
                tokens_per_pass=round(result.tokens_per_pass, 3), tokens_per_second=round(result.tokens_per_second, 3),
                budget=result.passes[-1].budget if result.passes else 0, seconds=round(result.seconds, 3),
                prefill_seconds=round(result.prefill_seconds, 3),
                queued_seconds=round(job.queued_seconds, 3), finish_reason=finish_reason(result))


def _error_response(request: Request, error: APIError) -> JSONResponse:
    _request_log(request).write(error.status, error=error.message)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _engine_error(exc: BaseException) -> APIError:
    """What a failure raised by a job becomes for its client."""
    if isinstance(exc, OffspecError):
        return APIError(400, str(exc))
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), type="server_error", code="shutting_down")
    log.error("generation failed", exc_info=exc)
    return APIError(500, f"the generation failed: {type(exc).__name__}: {exc}", type="server_error")


async def _cancel_on_disconnect(request: Request, engine: EngineQueue, job: Job) -> None:
    """Wait for the client to go away (the body is read, so the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.withdraw(job)


def _text_chunk(shape: Shape, split: Split, logprobs=None) -> dict:
    """A chunk of content and reasoning; a chunk of reasoning alone has no `content` (as llama.cpp's)."""
    content = split.answer if split.answer or not split.reasoning else None
    return shape.text_chunk(content, logprobs, split.reasoning)


async def _chain(first: StreamEvent, rest: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    yield first
    async for event in rest:
        yield event


def _tool_plan(req: GenerationRequest, generator) -> tuple[Optional[ToolPlan], object, dict]:
    """(the tool plan where the model may call tools, else None; the prompt; the generator's options) of a request.
    A chat whose messages hold earlier calls or results goes through the plan too (a template without tools gets
    them as text)."""
    options = dict(req.options)
    history = req.chat and any(m.get("tool_calls") or m["role"] == "tool" for m in req.prompt)
    if req.tools is None and not history:
        return None, req.prompt, options
    try:
        tools = plan(req.tools, req.prompt, generator.tokenizer)
    except OffspecError as exc:
        raise APIError(400, str(exc), param="messages") from None
    if tools.template_tools:
        options["tools"] = tools.template_tools
    if tools.grammar:
        options["grammar"] = tools.grammar
    calls = req.tools is not None and req.tools.choice != "none"
    return (tools if calls else None), tools.messages, options


def create_app(generator, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The app serving `generator` (an `offspec.Generator`, or anything with its `info`, `stream` and
    `tokenize`). Its engine worker starts and stops with the app (`app.state.engine`)."""
    engine = EngineQueue(generator, max_waiting=config.max_waiting)
    model_id = config.model_name or generator.info.target
    created = int(time.time())
    reasoning = getattr(generator, "reasoning", None)  # offspec.util.reasoning's format; None: the model has none

    def reasoning_of(req: GenerationRequest):
        """The format a request's reply is split by: none for completions, nor where it asks for none."""
        wanted = req.reasoning_format or config.reasoning_format
        if not req.chat or wanted == "none":
            return None
        forced_call = req.tools is not None and req.tools.choice in ("required", "function")
        if "json_schema" in req.options or forced_call:  # held to a grammar from the first token
            return held_from_start(reasoning)
        return reasoning

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.close, config.shutdown_grace_seconds)

    app = FastAPI(title="offspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        return _error_response(request, APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                                 f"{exc.detail}", code=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # Starlette re-raises it after: uvicorn logs the traceback
        return _error_response(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                 type="server_error"))

    async def require_key(request: Request) -> None:
        _request_log(request)
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid API key: send the server's key as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @app.get("/health")
    async def health(request: Request):
        _request_log(request).write(200)
        return {"status": "ok", "model": model_id, "queue": engine.status()}

    def model_card() -> dict:
        info = generator.info
        return {"id": model_id, "object": "model", "created": created, "owned_by": "offspec",
                "offspec": {"target": info.target, "draft": info.draft, "device": info.device, "dtype": info.dtype,
                            "max_context": info.max_context, "budget": info.default_budget,
                            "budget_source": info.extra.get("budget_source"),
                            "reasoning": reasoning.kind if reasoning is not None else None}}

    @v1.get("/models")
    async def models(request: Request):
        _request_log(request).write(200)
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{name:path}")
    async def model(request: Request, name: str):
        if name != model_id:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_id}'",
                           param="model", code="model_not_found")
        _request_log(request).write(200)
        return model_card()

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = parse_chat(await request.body(), default_max_tokens=generator.info.max_context)
        return await _generate(request, req)

    @v1.post("/completions")
    async def completions(request: Request):
        return await _generate(request, parse_completion(await request.body()))

    async def _generate(request: Request, req: GenerationRequest):
        if req.model != model_id:
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{model_id}'",
                           param="model", code="model_not_found")
        rec = _request_log(request)
        tools, prompt, options = _tool_plan(req, generator)
        token_bytes = generator.token_bytes if options.get("logprobs") is not None else None
        shape = Shape(req.chat, model_id, req.return_token_ids, token_bytes)
        rec.fields.update(id=shape.id, stream=req.stream, **({"user": req.user} if req.user else {}))
        job = Job(prompt=prompt, options=options, raw=isinstance(prompt, str) and not req.chat)
        try:
            engine.submit(job)
        except QueueFull as exc:
            raise APIError(429, f"the server is busy ({engine.max_waiting} requests are waiting); retry after "
                                f"{exc.retry_after} s", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        except ShuttingDown as exc:
            raise _engine_error(exc) from None
        events = engine.events(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, engine, job))
        try:  # wait for the first pass, so that a refused prompt is still an HTTP error
            first = await events.__anext__()
            result = first
            if not req.stream:
                async for result in events:
                    pass
        except BaseException as exc:  # a refused prompt, a shutdown, or this request task cancelled
            engine.withdraw(job)
            if isinstance(exc, Exception):
                raise _engine_error(exc) from None
            raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

        def special(ids) -> str:  # a reply with tools is read with special tokens: some formats' markers are ones
            return generator.decode(ids, special=True)

        if req.stream:
            reply = ReplyStream(reasoning_of(req), ToolStream(tools.format, req.tools.names) if tools else None,
                                special if tools else None)
            return EventSourceResponse(_sse(req, shape, job, _chain(first, events), rec, reply), ping=15,
                                       shutdown_grace_period=config.shutdown_grace_seconds)
        if result.stop_reason == "cancelled":  # the client is gone: nobody reads this answer
            rec.write(499, **_result_fields(result, job))
            return JSONResponse({}, status_code=499)
        split, parsed = whole_reply(special(result.token_ids) if tools else result.text, reasoning_of(req),
                                    tools.format if tools else None, req.tools.names if tools else ())
        rec.write(200, **_result_fields(result, job), **({"tool_calls": len(parsed.calls)} if parsed else {}))
        return shape.whole(result, job.queued_seconds, parsed, split)

    async def _sse(req: GenerationRequest, shape: Shape, job: Job, events: AsyncIterator[StreamEvent],
                   rec: RequestLog, reply: ReplyStream) -> AsyncIterator[str]:
        sent_tokens = 0
        try:
            yield json.dumps(shape.first_chunk())
            result: Optional[GenerationResult] = None
            async for event in events:
                if isinstance(event, GenerationResult):
                    result = event
                    continue
                sent_tokens += len(event.token_ids)
                split = reply.feed(event)
                if split.answer or split.reasoning or event.logprobs:
                    yield json.dumps(_text_chunk(shape, split, event.logprobs or None))
            split, calls = reply.finish()
            if split.answer or split.reasoning:
                yield json.dumps(_text_chunk(shape, split))
            finish = None
            if calls:
                yield json.dumps(shape.tool_chunk(calls))
                finish = "tool_calls"
            yield json.dumps(shape.last_chunk(result, job.queued_seconds, finish))
            if req.include_usage:
                yield json.dumps(shape.usage_chunk(result))
            yield "[DONE]"
            rec.write(200, **_result_fields(result, job))
        except Exception as exc:  # a failure after the stream began: OpenAI's error object as the last event
            error = _engine_error(exc)
            yield json.dumps(error.body())
            rec.write(error.status, error=error.message, completion_tokens=sent_tokens)
        finally:
            engine.withdraw(job)  # a client gone mid-stream: its generation stops after the current pass
            rec.write(499, finish_reason="disconnected", completion_tokens=sent_tokens)

    app.include_router(v1)
    return app
