"""`SandboxPool`: keeps `size` sandboxes of one template started, so `acquire()` returns one without the
start-up wait. A sandbox is used once: `release()` kills it and the pool starts a fresh one, so no state
passes from one user to the next."""

from __future__ import annotations

import queue
import threading

from k3.sandbox.sandbox import Sandbox
from k3.sandbox.types import Limits, SandboxError


class SandboxPool:
    def __init__(self, size: int, template: str = "python", backend: str = "gvisor",
                 limits: Limits | None = None, timeout: float = 300, root=None):  # fmt: skip
        if size < 1:
            raise SandboxError(f"pool size must be >= 1, got {size}")
        self.size, self.template, self.backend = size, template, backend
        self.limits, self.timeout, self.root = limits, timeout, root
        self._ready: queue.Queue[Sandbox] = queue.Queue()
        self._wanted = threading.Semaphore(size)  # one permit per sandbox the pool still has to start
        self._closed = threading.Event()
        self._filler = threading.Thread(target=self._fill, name="sandbox-pool", daemon=True)
        self._filler.start()

    def _new(self) -> Sandbox:
        return Sandbox.create(self.template, self.timeout, self.limits, self.backend, root=self.root)

    def _fill(self) -> None:
        while not self._closed.is_set():
            if not self._wanted.acquire(timeout=0.1):
                continue
            try:
                sbx = self._new()
            except SandboxError:
                self._wanted.release()
                self._closed.wait(1.0)  # try again shortly rather than spin
                continue
            if self._closed.is_set():
                sbx.kill()
                return
            self._ready.put(sbx)

    def acquire(self, timeout: float = 60.0) -> Sandbox:
        """A started sandbox (waiting up to `timeout` seconds for one if none is ready)."""
        if self._closed.is_set():
            raise SandboxError("the pool is closed")
        try:
            sbx = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise SandboxError(f"no sandbox ready within {timeout} s") from None
        self._wanted.release()
        return sbx

    def release(self, sbx: Sandbox) -> None:
        sbx.kill()

    def ready(self) -> int:
        return self._ready.qsize()

    def close(self) -> None:
        """Stop refilling and kill the sandboxes still waiting."""
        self._closed.set()
        self._filler.join(timeout=60)
        while not self._ready.empty():
            self._ready.get_nowait().kill()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
