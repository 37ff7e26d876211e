"""How the server's answers travel: server-sent events, the choices of a request merged as they come, and a
plain (not streamed) request that notices its client has gone.

    yield sse({"choices": [...]})                     # one `data: {...}` event; sse("[DONE]") ends a stream
    async for index, item in merged(sources): ...     # several choices' async iterators as one
    return streamed(chunks)                           # a StreamingResponse; a late APIError as an event
    await gather_plain(request, sources, add)         # every choice to its end; cancelled if the client goes
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from k3.engine.protocol import APIError

DISCONNECT_POLL_S = 0.25  # plain requests: how often a waiting request checks that its client is there


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def merged(sources: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, item) from several async iterators as they come; the first error is raised; closing this
    generator cancels the rest (and so their requests)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, source: AsyncIterator) -> None:
        try:
            async for item in source:
                await queue.put((i, item))
        except Exception as e:  # handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def streamed(chunks: AsyncIterator[str]) -> StreamingResponse:
    """The response of a streamed request: its chunks, then `[DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:  # after the 200 went out: an error event (the openai client raises it)
            yield sse(e.body())
        yield sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream")


async def gather_plain(request: Request, sources: list[AsyncIterator], add: Callable) -> None:
    """Run every choice to its end, feeding items to `add(index, item)`; if the client disconnects
    (polled), cancel them all."""

    async def consume() -> None:
        async for index, item in merged(sources):
            add(index, item)

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                return
    finally:
        task.cancel()  # a no-op once done
    task.result()  # raises the choices' first error
