"""An OpenAI-compatible HTTP server: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`,
and the tokenizer's `/tokenize`, `/detokenize`, `/tokenizer_info` (k3.engine.tokenize_api).

All requests share one `Engine` through an `EngineWorker` thread (continuous batching); each choice of a
request (`n`, a list of prompts) is one sequence. Responses follow OpenAI's schemas, plain or streamed as
server-sent events (`data: {...}` lines, then `data: [DONE]`), with `logprobs` (chat: `logprobs` +
`top_logprobs`; completions: `logprobs` int + `echo`, including `max_tokens: 0` to score a prompt). See
docs/engine.md for which log-probabilities these are.

It sheds load instead of falling over: past `max_batch + max_queue` requests in flight, 429 with
`Retry-After`; a request past `request_timeout` seconds is cancelled and answered 504; a client that goes
away cancels its sequences (streams: at once, the worker drops them before its next step; plain
requests: polled every 0.25 s). Bad input is 4xx naming the problem: 422 for malformed JSON or wrong
types (the field), 400 for what the model cannot run (empty or too long prompts: both lengths), 404 for an
unknown model, 401 without the `api_key` bearer token when one is set.

Chat requests are written in K3's chat format (k3.chat, mapped by k3.engine.chat: tools, tool_choice,
response_format, reasoning_effort, chat_template_kwargs) and replies carry `reasoning_content` and
`tool_calls`. Extensions beyond OpenAI's parameters: `top_k`, `repetition_penalty`, `ignore_eos`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from k3.engine.chat import finish_reason, reply_message, reply_parser, tool_call_deltas
from k3.engine.chat_inputs import chat_images, encode_request, prompt_ids
from k3.engine.generate import Engine
from k3.engine.images import ImageInput
from k3.engine.outputs import (
    LegacyLogprobs,
    Piece,
    PlainText,
    StopStrings,
    chat_logprobs,
    choice_pieces,
    merge_legacy,
)
from k3.engine.prefix_cache import cached_tokens
from k3.engine.protocol import (
    APIError,
    ChatBody,
    CompletionBody,
    SamplingBody,
    invalid,
    refuse_not_implemented,
    validation_error,
)
from k3.engine.remote_images import RemoteImages
from k3.engine.responses import gather_plain, merged, sse, streamed
from k3.engine.sampling import SamplingError, SamplingParams
from k3.engine.sequence import Event
from k3.engine.tokenize_api import add_tokenize_routes
from k3.engine.worker import EngineWorker, Handle, QueueFull
from k3.errors import K3Error
from k3.listen import BodyLimit
from k3.tokenizer.kimi import Tokenizer

MAX_REQUEST_BYTES = 64 * 2**20  # a chat with an image or two as data URLs (one image: up to 32 MiB encoded)


@dataclass
class Outcome:
    """One choice, accumulated (plain responses)."""

    content: str = ""
    reasoning: str = ""
    logprobs: list[dict] = field(default_factory=list)  # completions: legacy parts; chat: unused
    events: list[Event] = field(default_factory=list)
    tool_calls: list = field(default_factory=list)  # chat: k3.chat.parser.ToolCall
    finish_reason: str | None = None
    count: int = 0


class BearerAuth:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer <key>` (else 401). Plain ASGI, so
    streaming and disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "a valid API key is needed: Authorization: Bearer <key>",
                    "authentication_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    model_name: str,
    *,
    max_queue: int = 64,
    default_max_tokens: int = 256,
    request_timeout: float | None = None,
    api_key: str | None = None,
    remote_images: RemoteImages | None = None,
    max_images: int = 8,
    max_image_tokens: int | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> FastAPI:
    """The FastAPI app; starts the engine thread on startup and stops it on shutdown. Images (chat
    `image_url` parts, k3.engine.images): data URLs; http(s) under `remote_images` (None: refused); at most
    `max_images` a request and `max_image_tokens` an image. A body over `max_request_bytes` gets 413."""
    worker = EngineWorker(engine, max_queue=max_queue)
    created = int(time.time())
    stop_ids = frozenset({tokenizer.special.eos, tokenizer.special.end_of_msg})

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        worker.stop()

    app = FastAPI(title="k3", version="0.1.0", lifespan=lifespan)
    app.state.worker, app.state.request_timeout = worker, request_timeout

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key is not None:  # added last, so outermost: a request without the key is refused unread
        app.add_middleware(BearerAuth, key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return validation_error(list(e.errors())).response()

    @app.get("/health")
    async def health() -> dict:
        doc = {
            "status": "ok" if worker.error is None else "degraded",
            "in_flight": worker.in_flight,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
        }
        if engine.prefix_cache is not None:
            doc["prefix_cache"] = engine.prefix_cache.health()
        return doc

    @app.get("/v1/models")
    async def models() -> dict:
        model = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "k3",
            "max_model_len": engine.max_context,
            "root": getattr(engine.model, "source", None),  # where it was loaded from (Hub: @<commit>)
        }
        return {"object": "list", "data": [model]}

    # ---- shared steps ------------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404, f"The model '{name}' does not exist", "invalid_request_error", "model", "model_not_found"
            )

    def check_ids(ids: list[int], param: str) -> None:
        if not ids:
            raise invalid(f"{param}: must not be empty", param)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise invalid(
                f"{param}: token ids {bad[:5]} are outside the vocabulary (0..{tokenizer.vocab_size - 1})",
                param,
            )

    def budget(body: SamplingBody, prompt: list[int], param: str, zero_ok: bool) -> int:
        """max_tokens for this prompt: as asked (checked against the context), or the default if it fits."""
        ctx = engine.max_context
        if len(prompt) >= ctx:
            raise invalid(
                f"{param}: the prompt has {len(prompt)} tokens; this model's maximum context length is {ctx} "
                "tokens (the prompt must be shorter, to leave room for one generated token)",
                param,
            )
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if asked is None:
            return min(default_max_tokens, ctx - len(prompt))
        if asked == 0 and not zero_ok:
            raise invalid(
                "max_tokens: must be at least 1 (0 only with echo, to score the prompt)", "max_tokens"
            )
        if len(prompt) + asked > ctx:
            raise invalid(
                f"max_tokens: the prompt has {len(prompt)} tokens and max_tokens is {asked}, "
                f"together more than this model's maximum context length of {ctx} tokens",
                "max_tokens",
            )
        return asked

    def sampling(body: SamplingBody, max_tokens: int, choice: int, **logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=body.temperature,
                top_k=body.top_k,
                top_p=body.top_p,
                repetition_penalty=body.repetition_penalty,
                max_tokens=max_tokens,
                stop_ids=frozenset() if body.ignore_eos else stop_ids,
                seed=None if body.seed is None else body.seed + choice,  # the n choices differ, reproducibly
                **logprobs,  # type: ignore[arg-type]
            )
        except SamplingError as e:
            raise invalid(str(e)) from e

    def submit_all(
        requests: list[tuple[list[int], SamplingParams]], images: list | None = None, param: str = "n"
    ) -> list[Handle]:
        """Admit every choice or none: 429 with Retry-After when the queue is full, 400 (naming `param`)
        when the request alone asks for more sequences than the server ever holds, which no retry mends."""
        if len(requests) > worker.capacity:
            raise invalid(
                f"{param}: this request asks for {len(requests)} sequences (prompts times n), more than the "
                f"server runs and queues at once ({worker.capacity}: --max-batch + --max-queue); "
                "send them in smaller requests",
                param,
            )
        handles: list[Handle] = []
        try:
            for prompt, params in requests:
                handles.append(worker.submit(prompt, params, images))
        except QueueFull as e:
            for handle in handles:
                worker.cancel(handle)
            raise APIError(429, str(e), "rate_limit_error", None, "queue_full", {"Retry-After": "1"}) from e
        return handles

    def unpack(item: Event | BaseException | None) -> Event | None:
        """An item of a handle's queue: the event, None at the end, or the error raised as an APIError."""
        if isinstance(item, K3Error):
            raise invalid(str(item))
        if isinstance(item, BaseException):
            raise APIError(500, f"generation failed: {item}", "server_error")
        return item

    async def events(handle: Handle, deadline: float | None) -> AsyncIterator[Event]:
        """A request's events until its end; past the deadline, 504. Closing it (a client gone, a stop
        string found) cancels the sequence."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    wait = None if deadline is None else max(0.0, deadline - loop.time())
                    item = await asyncio.wait_for(handle.events.get(), timeout=wait)
                except TimeoutError:
                    raise APIError(
                        504,
                        f"the request took longer than the request timeout ({request_timeout} s)",
                        "timeout_error",
                        None,
                        "request_timeout",
                    ) from None
                if (event := unpack(item)) is None:
                    return
                yield event
        finally:
            worker.cancel(handle)

    def deadline() -> float | None:
        return None if request_timeout is None else asyncio.get_running_loop().time() + request_timeout

    def usage(prompts: list[list[int]], completion: int, handles: list[Handle]) -> dict:
        prompt = sum(len(p) for p in prompts)
        cached = cached_tokens([h.seq.cached if h.seq else 0 for h in handles], len(prompts))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ---- /v1/completions ---------------------------------------------------------------------------------
    def completion_prompts(body: CompletionBody) -> list[tuple[list[int], str]]:
        """(ids, text) of each prompt: a string, strings, token ids or lists of token ids."""
        p = body.prompt
        if isinstance(p, str):
            texts: list = [p]
        elif all(isinstance(x, str) for x in p):
            texts = list(p)
        elif all(isinstance(x, int) for x in p):
            texts = [p]
        else:
            texts = list(p)
        out = []
        for i, item in enumerate(texts):
            param = "prompt" if len(texts) == 1 else f"prompt[{i}]"
            ids = tokenizer.encode(item) if isinstance(item, str) else list(item)
            check_ids(ids, param)
            out.append((ids, item if isinstance(item, str) else tokenizer.decode(ids)))
        return out

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        check_model(body.model)
        refuse_not_implemented(body)
        prompts = completion_prompts(body)
        want = body.logprobs is not None
        choices: list[tuple[list[int], str]] = []
        requests = []
        for i, (ids, text) in enumerate(prompts):
            max_tokens = budget(
                body, ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]", zero_ok=body.echo
            )
            for j in range(body.n):
                logprobs = {
                    "logprobs": body.logprobs or 0,
                    "prompt_logprobs": body.logprobs if body.echo and want else None,
                }
                requests.append((ids, sampling(body, max_tokens, j, **logprobs)))
                choices.append((ids, text))
        StopStrings(body.stop)  # checked before anything runs
        handles = submit_all(requests, param="prompt" if len(prompts) > 1 else "n")
        rid, now, end = f"cmpl-{uuid.uuid4().hex}", int(time.time()), deadline()

        async def choice(
            handle: Handle, ids: list[int], text: str
        ) -> AsyncIterator[tuple[str, dict | None, Piece]]:
            legacy, first = LegacyLogprobs(tokenizer), True
            async for piece in choice_pieces(
                events(handle, end), PlainText(tokenizer), StopStrings(body.stop)
            ):
                out, parts = piece.content, []
                if first and body.echo:
                    out = text + out
                    if want and handle.seq is not None:
                        parts.append(legacy.entries(ids, handle.seq.prompt_logprobs, handle.seq.prompt_top))
                first = False
                if want:
                    parts.append(legacy.of_events(piece.tokens))
                yield out, merge_legacy(parts) if want else None, piece

        sources = [choice(h, ids, text) for h, (ids, text) in zip(handles, choices, strict=True)]

        def chunk(choices_: list[dict]) -> dict:
            return {
                "id": rid,
                "object": "text_completion",
                "created": now,
                "model": model_name,
                "choices": choices_,
            }

        def one(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
            return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}

        if body.stream:

            async def stream() -> AsyncIterator[str]:
                counts = [0] * len(sources)
                async for index, (text, logprobs, piece) in merged(sources):
                    counts[index] = piece.count
                    if text or piece.finish_reason or (logprobs and logprobs["tokens"]):
                        yield sse(chunk([one(index, text, logprobs, piece.finish_reason)]))
                if body.stream_options and body.stream_options.include_usage:
                    yield sse(
                        {**chunk([]), "usage": usage([ids for ids, _ in prompts], sum(counts), handles)}
                    )

            return streamed(stream())

        outcomes = [Outcome() for _ in sources]

        def add(index: int, item: tuple[str, dict | None, Piece]) -> None:
            text, logprobs, piece = item
            o = outcomes[index]
            o.content += text
            o.finish_reason, o.count = piece.finish_reason, piece.count
            if logprobs is not None:
                o.logprobs.append(logprobs)

        await gather_plain(request, sources, add)
        return {
            **chunk(
                [
                    one(i, o.content, merge_legacy(o.logprobs) if want else None, o.finish_reason)
                    for i, o in enumerate(outcomes)
                ]
            ),
            "usage": usage([ids for ids, _ in prompts], sum(o.count for o in outcomes), handles),
        }

    # ---- /v1/chat/completions ----------------------------------------------------------------------------
    async def images_of(messages: list) -> list[ImageInput] | None:
        """A chat's images, checked and preprocessed under this server's settings (also for /tokenize), in a
        worker thread: decoding and resizing a large image takes long enough to stall every stream."""
        return await run_in_threadpool(
            chat_images,
            engine.model,
            messages,
            remote=remote_images,
            max_images=max_images,
            max_tokens=max_image_tokens,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        check_model(body.model)
        refuse_not_implemented(body)
        if body.top_logprobs and not body.logprobs:
            raise invalid("top_logprobs: needs logprobs: true", "top_logprobs")
        images = await images_of(body.messages)
        chat = encode_request(body, body.messages, images)
        prompt = prompt_ids(tokenizer, chat)
        max_tokens = budget(body, prompt, "messages", zero_ok=False)
        top = body.top_logprobs or 0
        StopStrings(body.stop)
        choices = [(prompt, sampling(body, max_tokens, j, logprobs=top)) for j in range(body.n)]
        handles = submit_all(choices, images)
        rid, now, end = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), deadline()
        sources = [
            choice_pieces(events(h, end), reply_parser(tokenizer, chat), StopStrings(body.stop))
            for h in handles
        ]

        def chunk(choices_: list[dict]) -> dict:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": now,
                "model": model_name,
                "choices": choices_,
            }

        if body.stream:

            async def stream() -> AsyncIterator[str]:
                yield sse(
                    chunk(
                        [
                            {
                                "index": j,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                            for j in range(body.n)
                        ]
                    )
                )
                counts, called = [0] * body.n, [False] * body.n
                async for index, piece in merged(sources):
                    counts[index] = piece.count
                    called[index] = called[index] or bool(piece.tool_calls)
                    delta: dict = {
                        k: v
                        for k, v in (("reasoning_content", piece.reasoning), ("content", piece.content))
                        if v
                    }
                    if piece.tool_calls:
                        delta["tool_calls"] = tool_call_deltas(piece.tool_calls)
                    finish = piece.finish_reason
                    if finish == "stop" and called[index]:
                        finish = "tool_calls"
                    logprobs = (
                        chat_logprobs(tokenizer, piece.tokens) if body.logprobs and piece.tokens else None
                    )
                    if delta or finish or logprobs:
                        yield sse(
                            chunk(
                                [
                                    {
                                        "index": index,
                                        "delta": delta,
                                        "logprobs": logprobs,
                                        "finish_reason": finish,
                                    }
                                ]
                            )
                        )
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**chunk([]), "usage": usage([prompt], sum(counts), handles)})

            return streamed(stream())

        outcomes = [Outcome() for _ in sources]

        def add(index: int, piece: Piece) -> None:
            o = outcomes[index]
            o.content, o.reasoning = o.content + piece.content, o.reasoning + piece.reasoning
            o.events += piece.tokens
            o.tool_calls += piece.tool_calls
            o.finish_reason, o.count = piece.finish_reason, piece.count

        await gather_plain(request, sources, add)
        choices = [
            {
                "index": i,
                "message": reply_message(o.reasoning, o.content, o.tool_calls),
                "logprobs": chat_logprobs(tokenizer, o.events) if body.logprobs else None,
                "finish_reason": finish_reason(o.finish_reason, o.tool_calls),
            }
            for i, o in enumerate(outcomes)
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now,
            "model": model_name,
            "choices": choices,
            "usage": usage([prompt], sum(o.count for o in outcomes), handles),
        }

    add_tokenize_routes(app, engine, tokenizer, check_model, images_of)
    return app
