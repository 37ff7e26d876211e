"""An OpenAI-compatible HTTP server: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`.

All requests share one `Engine` through an `EngineWorker` thread (continuous batching). Responses follow
OpenAI's schemas, plain or streamed as server-sent events (`data: {...}` lines, then `data: [DONE]`).
Errors are OpenAI-style JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for invalid requests,
404 for an unknown model, 429 when the queue is full. A client that disconnects cancels its request,
which frees its cache. Chat replies put the think channel in `reasoning_content` (as DeepSeek's API).

Extensions beyond OpenAI's parameters: `top_k`, `repetition_penalty`, `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from k3.engine.chat import Message, ReplyStream, encode_chat
from k3.engine.generate import Engine, Event
from k3.engine.sampling import SamplingError, SamplingParams
from k3.engine.worker import EngineWorker, Handle, QueueFull
from k3.errors import K3Error
from k3.tokenizer.kimi import StreamDecoder, Tokenizer


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


# ---- request bodies (unknown fields are accepted and ignored, as OpenAI clients send many) ---------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0)
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # keep generating past stop ids (as vLLM), e.g. for benchmarks


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str]


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(SamplingBody):
    messages: list[ChatMessageBody] = Field(min_length=1)


def _message_text(m: ChatMessageBody) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:  # the list form: [{"type": "text", "text": ...}]
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid("only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


class StopStrings:
    """Cuts generated text at the first stop string; holds back text that could still begin one."""

    def __init__(self, stop: str | list[str] | None) -> None:
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(self.stops) > 4 or any(not s for s in self.stops):
            raise invalid("stop: at most 4 non-empty strings", "stop")
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything received
        self.sent = 0  # characters of `text` already released
        self.stopped = False

    def push(self, delta: str, final: bool = False) -> str:
        self.text += delta
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        else:
            end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    *,
    max_queue: int = 64,
    default_max_tokens: int = 256,
) -> FastAPI:
    """The FastAPI app; starts the engine thread on startup and stops it on shutdown."""
    worker = EngineWorker(engine, max_queue=max_queue)
    created = int(time.time())
    stop_ids = frozenset({tokenizer.special.eos, tokenizer.special.end_of_msg})

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="k3", version="0.1.0", lifespan=lifespan)
    app.state.worker = worker

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return invalid(message, ".".join(loc) or None).response()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok" if worker.error is None else "degraded", "in_flight": worker.in_flight}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "k3"}],
        }

    def sampling(body: SamplingBody) -> SamplingParams:
        if body.model != model_name:
            raise APIError(
                404,
                f"The model '{body.model}' does not exist",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        if body.n != 1:
            raise invalid("n: only n=1 is supported", "n")
        try:
            return SamplingParams(
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                repetition_penalty=body.repetition_penalty,
                max_tokens=body.max_completion_tokens or body.max_tokens or default_max_tokens,
                stop_ids=frozenset() if body.ignore_eos else stop_ids,
                seed=body.seed,
            )
        except SamplingError as e:
            raise invalid(str(e)) from e

    def submit(prompt: list[int], params: SamplingParams) -> Handle:
        if len(prompt) + params.max_tokens > engine.max_context:
            raise invalid(
                f"This model's maximum context length is {engine.max_context} tokens; the prompt has "
                f"{len(prompt)} and max_tokens is {params.max_tokens}",
                "max_tokens",
            )
        try:
            return worker.submit(prompt, params)
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", None, "queue_full") from e

    def unpack(item: Event | BaseException | None) -> Event | None:
        """An item of a handle's queue: the event, None at the end, or the error raised as an APIError."""
        if isinstance(item, K3Error):
            raise invalid(str(item))
        if isinstance(item, BaseException):
            raise APIError(500, f"generation failed: {item}", "server_error")
        return item

    async def events(handle: Handle) -> AsyncIterator[Event]:
        """The request's events (streaming: a client that goes away closes this generator, which cancels)."""
        try:
            while (event := unpack(await handle.events.get())) is not None:
                yield event
        finally:
            worker.cancel(handle)

    async def collect(request: Request, handle: Handle) -> AsyncIterator[Event]:
        """`events` for plain requests, where nothing is written until the end: checks for a disconnected
        client every half second (between events, or while waiting for one)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
                if loop.time() - checked >= 0.5:
                    if await request.is_disconnected():
                        return
                    checked = loop.time()
                try:
                    item = await asyncio.wait_for(handle.events.get(), timeout=0.5)
                except TimeoutError:
                    continue
                if (event := unpack(item)) is None:
                    return
                yield event
        finally:
            worker.cancel(handle)

    def usage(prompt: list[int], completion: int) -> dict:
        return {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion,
            "total_tokens": len(prompt) + completion,
        }

    def sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"

    # ---- /v1/completions ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        params = sampling(body)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            if len(body.prompt) != 1:
                raise invalid("prompt: only one prompt per request is supported", "prompt")
            body.prompt = body.prompt[0]
        prompt = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if not prompt:
            raise invalid("prompt: must not be empty", "prompt")
        if any(not 0 <= t < tokenizer.vocab_size for t in prompt):
            raise invalid("prompt: token ids outside the vocabulary", "prompt")
        stops = StopStrings(body.stop)
        handle = submit(prompt, params)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, finish: str | None) -> dict:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
            return {
                "id": rid,
                "object": "text_completion",
                "created": now,
                "model": model_name,
                "choices": [choice],
            }

        async def run(source: AsyncIterator[Event]) -> AsyncIterator[tuple[str, str | None, int]]:
            decoder, count = StreamDecoder(tokenizer), 0
            async for event in source:
                text = decoder.push(event.token) if event.token is not None else ""
                count += event.token is not None
                if event.finish_reason is not None:
                    out = stops.push(text + decoder.flush(), final=True)
                    yield out, "stop" if stops.stopped else event.finish_reason, count
                    return
                out = stops.push(text)
                if stops.stopped:
                    yield out, "stop", count
                    return
                yield out, None, count

        if body.stream:

            async def stream() -> AsyncIterator[str]:
                count = 0
                async for text, finish, n in run(events(handle)):
                    count = n
                    if text or finish:
                        yield sse(chunk(text, finish))
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**chunk("", None), "choices": [], "usage": usage(prompt, count)})
                yield sse("[DONE]")

            return StreamingResponse(stream(), media_type="text/event-stream")

        text, finish, count = "", None, 0
        async for delta, end, n in run(collect(request, handle)):
            text, finish, count = text + delta, end, n
        return {**chunk(text, finish), "usage": usage(prompt, count)}

    # ---- /v1/chat/completions ----------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        params = sampling(body)
        messages = [
            Message("system" if m.role == "developer" else m.role, _message_text(m)) for m in body.messages
        ]
        prompt = encode_chat(tokenizer, messages)
        stops = StopStrings(body.stop)
        handle = submit(prompt, params)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict, finish: str | None) -> dict:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": now,
                "model": model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }

        async def run(source: AsyncIterator[Event]) -> AsyncIterator[tuple[str, str, str | None, int]]:
            reply, count = ReplyStream(tokenizer), 0
            async for event in source:
                reasoning, content = reply.push(event.token) if event.token is not None else ("", "")
                count += event.token is not None
                if event.finish_reason is not None:
                    r_tail, c_tail = reply.flush()
                    out = stops.push(content + c_tail, final=True)
                    yield reasoning + r_tail, out, "stop" if stops.stopped else event.finish_reason, count
                    return
                out = stops.push(content)
                if stops.stopped or reply.channel == "done":
                    yield reasoning, out, "stop", count
                    return
                yield reasoning, out, None, count

        if body.stream:

            async def stream() -> AsyncIterator[str]:
                yield sse(chunk({"role": "assistant", "content": ""}, None))
                count = 0
                async for reasoning, content, finish, n in run(events(handle)):
                    count = n
                    delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
                    if delta or finish:
                        yield sse(chunk(delta, finish))
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**chunk({}, None), "choices": [], "usage": usage(prompt, count)})
                yield sse("[DONE]")

            return StreamingResponse(stream(), media_type="text/event-stream")

        reasoning, content, finish, count = "", "", None, 0
        async for r, c, end, n in run(collect(request, handle)):
            reasoning, content, finish, count = reasoning + r, content + c, end, n
        message = {"role": "assistant", "content": content.strip(), "reasoning_content": reasoning.strip()}
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now,
            "model": model_name,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt, count),
        }

    return app
