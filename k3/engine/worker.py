"""One thread that owns the `Engine` and steps it; asyncio code talks to it through queues.

Requests arrive from any thread (the server's event loop) through `submit`, which returns a `Handle`: an
`asyncio.Queue` the worker fills with `Event`s (via `loop.call_soon_threadsafe`) and finally an end marker.
`cancel` asks the worker to drop a request (its cache is freed at the next step). Admission is bounded:
at most `max_batch + max_queue` requests in flight; `submit` raises `QueueFull` beyond that (HTTP 429).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from k3.engine.generate import Engine
from k3.engine.sampling import SamplingParams
from k3.engine.sequence import Event, Sequence
from k3.errors import K3Error


class QueueFull(K3Error):
    """Too many requests in flight."""


@dataclass(eq=False)
class Handle:
    """The asyncio side of one request. `events` yields Event objects, then an Exception or None (done)."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    images: list | None = None  # k3.engine.images.ImageInput per image of the prompt

    def deliver(self, item: Event | BaseException | None) -> None:
        """Called from the worker thread."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineWorker:
    def __init__(self, engine: Engine, max_queue: int = 64) -> None:
        self.engine = engine
        self.capacity = engine.max_batch + max_queue
        self._inbox: queue.Queue[tuple[str, Handle]] = queue.Queue()
        self._in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k3-engine", daemon=True)
        self._handles: dict[int, Handle] = {}  # id(seq) -> handle, owned by the worker thread
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))  # type: ignore[arg-type]
        self._thread.join(timeout=10)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, prompt: list[int], params: SamplingParams, images: list | None = None) -> Handle:
        """Queue a request (call from the event loop). Raises QueueFull when at capacity. `images` are
        encoded on the worker thread (Engine.submit)."""
        with self._lock:
            if self._in_flight >= self.capacity:
                raise QueueFull(
                    f"the server is at capacity ({self.capacity} requests in flight); retry later"
                )
            self._in_flight += 1
        handle = Handle(prompt, params, asyncio.get_running_loop(), images=images)
        self._inbox.put(("submit", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """Drop a request if it is still running (a no-op once it has finished)."""
        self._inbox.put(("cancel", handle))

    # ---- the worker thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_inbox(block=not self.engine.has_work)
                if self.engine.has_work:
                    for event in self.engine.step():
                        self._deliver(event)
            except Exception as e:  # a bug or an out-of-memory: fail every request, keep serving
                self.error = e
                for handle in list(self._handles.values()):
                    if handle.seq is not None:
                        self.engine.cancel(handle.seq)
                    self._finish(handle, e)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, handle = item
            if kind == "submit":
                try:
                    handle.seq = self.engine.submit(handle.prompt, handle.params, images=handle.images)
                    self._handles[id(handle.seq)] = handle
                except K3Error as e:
                    self._finish(handle, e)
            elif kind == "cancel" and handle.seq is not None and id(handle.seq) in self._handles:
                self.engine.cancel(handle.seq)
                self._finish(handle, None)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, event: Event) -> None:
        handle = self._handles.get(id(event.seq))
        if handle is None:
            return
        handle.deliver(event)
        if event.finish_reason is not None:
            self._finish(handle, None)

    def _finish(self, handle: Handle, end: BaseException | None) -> None:
        if handle.seq is not None:
            self._handles.pop(id(handle.seq), None)
        handle.deliver(end)
        with self._lock:
            self._in_flight -= 1
