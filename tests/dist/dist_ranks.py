"""R gloo ranks for the tests: spawned processes with the environment torchrun would give them, the
rendezvous store hosted here (as torchrun's agent hosts it).

    pool = Ranks(2)                    # starts 2 processes, kept for many calls (starting one costs seconds)
    results = pool.run(fn, *args)      # fn(comm, *args) on every rank -> {rank: None or its error text}
    pool.close()

`fn` must be a module-level function (the children import it). A call that fails on any rank, or does
not finish within `timeout` seconds, ends the processes; the next call starts new ones."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, port: int, collective_timeout: float, tasks, out) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    import torch

    torch.set_num_threads(1)
    from k3.dist.group import Comm

    comm = Comm.from_env(timeout=collective_timeout, backend="gloo")
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            with comm.guard():
                fn(comm, *args)
            out.put((rank, None))
        except BaseException as e:
            out.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            return


class Ranks:
    def __init__(self, world: int, collective_timeout: float = 20.0) -> None:
        self.world, self.collective_timeout = world, collective_timeout
        self.procs: list = []

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        port = free_port()
        self.store = dist.TCPStore(
            "127.0.0.1",
            port,
            None,
            is_master=True,
            timeout=datetime.timedelta(seconds=60),
            wait_for_workers=False,
        )
        self.out = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.procs = [
            ctx.Process(
                target=_serve, args=(r, self.world, port, self.collective_timeout, self.tasks[r], self.out)
            )
            for r in range(self.world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 120.0) -> dict:
        if not self.procs:
            self._start()
        for q in self.tasks:
            q.put((fn, args))
        results: dict = {}
        try:
            while len(results) < self.world:
                rank, error = self.out.get(timeout=timeout)
                results[rank] = error
        except queue.Empty:
            pass
        for rank in range(self.world):
            results.setdefault(rank, "hung")
        if any(error is not None for error in results.values()):
            self.close()
        return results

    def close(self) -> None:
        for q in self.tasks if self.procs else []:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []


def assert_ok(results: dict) -> None:
    failed = {rank: error for rank, error in results.items() if error is not None}
    assert not failed, "\n".join(f"rank {rank}: {error}" for rank, error in sorted(failed.items()))
