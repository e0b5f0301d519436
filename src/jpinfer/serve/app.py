"""The HTTP side of ``jpinfer serve``: aiohttp routes for OpenAI's chat and text completions (whole, or
streamed as server-sent events), the model list and a health check, with the API key, the body limit and
every error in OpenAI's error shape.

Why aiohttp: one well-kept package that is both the asyncio server and its streaming responses, with a
request body limit, handler cancellation when a client disconnects (a gone client's job is cancelled at
once, so its slot frees before the next step) and a graceful shutdown on SIGTERM built in; FastAPI would
add Starlette, Uvicorn and Pydantic for the same four routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
from typing import Any

from aiohttp import web

from jpinfer.serve.openai_api import Answer, ApiError, budget, parse
from jpinfer.serve.scheduler import Busy, Closed, Scheduler

SCHEDULER = web.AppKey("scheduler", Scheduler)
SETTINGS = web.AppKey("settings", dict)


def _error(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as OpenAI's error object, and the API key checked first."""
    key = request.app[SETTINGS]["api_key"]
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            return _error(ApiError(401, "Incorrect API key provided (send it as 'Authorization: Bearer <key>')",
                                   code="invalid_api_key"))
    try:
        return await handler(request)
    except ApiError as error:
        return _error(error)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS]["max_body"]
        return _error(ApiError(413, f"the request body is over this server's limit of {limit} bytes"))
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return _error(ApiError(error.status, error.reason, type="not_found_error" if error.status == 404 else
                               "invalid_request_error"))
    except (asyncio.CancelledError, ConnectionError):  # the client is gone: nobody to answer
        raise
    except Exception as error:  # a bug of ours: still an answer in the API's shape, and the server goes on
        return _error(ApiError(500, f"internal error: {type(error).__name__}: {error}", type="server_error"))


async def _body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None


def _tokens(engine: Any, completion) -> list[int]:
    try:
        return engine.encode_prompt(completion.prompt, chat=completion.chat)
    except ValueError as error:  # roles outside the template's, ids out of range, no template
        raise ApiError(400, str(error), param="messages" if completion.chat else "prompt") from None


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    scheduler = request.app[SCHEDULER]
    completion = parse(await _body(request), chat=chat, served=request.app[SETTINGS]["model"])
    prompt_ids = _tokens(scheduler.engine, completion)
    config = dataclasses.replace(completion.config, max_new_tokens=budget(completion, len(prompt_ids),
                                                                          scheduler.context))
    try:
        job = scheduler.submit(prompt_ids, config, asyncio.get_running_loop())
    except Busy:
        raise ApiError(503, f"the server is busy: {scheduler.max_waiting} requests are waiting already; retry later",
                       type="server_error", code="overloaded") from None
    except Closed:
        raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down") from None
    answer = Answer(completion)
    try:
        if completion.stream:
            return await _stream(request, job, answer, completion.include_usage)
        while True:
            kind, value = await job.events.get()
            if kind == "done":
                return web.json_response(answer.whole(value))
            if kind == "error":
                raise ApiError(500, value, type="server_error")
    finally:  # a client gone (handler cancelled, or a write failed) frees its slot at once
        scheduler.cancel(job)


async def _stream(request: web.Request, job, answer: Answer, include_usage: bool) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    send = lambda chunk: response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    if answer.chat:
        await send(answer.chunk(first=True))
    while True:
        kind, value = await job.events.get()
        if kind == "text":
            await send(answer.chunk(value))
        elif kind == "done":
            await send(answer.finish_chunk(value))
            if include_usage:
                await send(answer.usage_chunk(value))
            break
        else:  # the status is sent already: the error goes in the stream, as OpenAI's streams carry them
            await send(ApiError(500, value, type="server_error").body())
            break
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    return web.json_response({"object": "list", "data": [{"id": settings["model"], "object": "model",
                                                          "created": settings["created"], "owned_by": "jpinfer"}]})


async def health(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER]
    status = "shutting down" if request.app[SETTINGS]["closing"] else "ok"
    return web.json_response({"status": status, "model": request.app[SETTINGS]["model"], **scheduler.counts()},
                             status=200 if status == "ok" else 503)


def create_app(scheduler: Scheduler, *, model: str, api_key: str | None, max_body: int,
               created: int) -> web.Application:
    """The application over a started ``scheduler``; it closes the scheduler to new jobs on shutdown (in-flight
    requests finish within aiohttp's shutdown timeout) and stops it on cleanup."""
    app = web.Application(middlewares=[_errors], client_max_size=max_body)
    app[SCHEDULER] = scheduler
    app[SETTINGS] = {"model": model, "api_key": api_key, "created": created, "closing": False, "max_body": max_body}

    async def on_shutdown(app: web.Application) -> None:
        app[SETTINGS]["closing"] = True
        scheduler.close()

    async def on_cleanup(app: web.Application) -> None:
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    app.add_routes([web.post("/v1/chat/completions", chat_completions), web.post("/v1/completions", completions),
                    web.get("/v1/models", models), web.get("/health", health)])
    return app
