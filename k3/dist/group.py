"""Process groups from torchrun's environment, and collectives that fail loudly instead of hanging.

    comm = Comm.from_env(timeout=30.0)       # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun sets them)
    with comm.guard():                       # an exception here is posted for every other rank to report
        comm.all_reduce_(grads)

Backend: NCCL when CUDA is present, gloo otherwise (or as asked: k3 trains on the CPU, with gloo).
Every collective goes through `Comm`, which counts it in the rendezvous store (`arrived/<rank>` += 1)
before entering. When a collective fails (gloo's timeout,
a peer that closed its connection), the store says why: a rank that raised posted its error there (see
`guard`), or the counters show which ranks never reached this collective. Either way the error names the
rank. Under torchrun the store is the agent's, so it outlives a worker that died.
"""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3.errors import K3Error

_FAILED = "failed"  # the first error a rank posted: "rank R: Type: message"
_FAILURES = "failures"  # how many ranks posted one (the first to count 1 writes `failed`)
RENDEZVOUS_S = 300.0  # how long ranks may take to join, whatever the collective timeout


class DistError(K3Error):
    """A collective that could not complete: which rank did not arrive, or which rank raised and why."""


def torchrun_env() -> bool:
    """Whether this process was started by torchrun (or anything that sets the same variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


@dataclass
class Comm:
    """One process group (the whole world) plus the store that explains its failures."""

    rank: int
    world: int
    store: dist.Store
    timeout: float
    device: torch.device
    group: dist.ProcessGroup  # all ranks, with the short collective timeout
    owns_group: bool = True  # False when the default group was already there (then `close` leaves it)

    @classmethod
    def from_env(cls, timeout: float = 60.0, backend: str | None = None) -> Comm:
        """Join the process group that torchrun's environment describes (the default group).

        `backend`: "gloo" (tensors on the CPU) or "nccl" (on this rank's GPU); by default NCCL when CUDA
        is present. k3's trainer and generator compute on the CPU and ask for gloo."""
        if not torchrun_env():
            raise DistError("not started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are unset")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        delta = datetime.timedelta(seconds=timeout)
        # joining may take longer than a collective may wait (ranks start seconds apart on a busy machine)
        joining = datetime.timedelta(seconds=max(timeout, RENDEZVOUS_S))
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        base = dist.TCPStore(host, port, world, is_master=rank == 0 and not agent_store, timeout=joining)
        run_id = (
            os.environ.get("TORCHELASTIC_RUN_ID", "k3")
            + f"/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        )
        cuda = torch.cuda.is_available() if backend is None else backend == "nccl"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        owns_group = not dist.is_initialized()
        name = "nccl" if cuda else "gloo"
        if owns_group:
            dist.init_process_group(
                name,
                store=dist.PrefixStore(f"{run_id}/pg", base),
                rank=rank,
                world_size=world,
                timeout=joining,
            )
        dist.barrier()  # every rank has joined: from here on a collective waits `timeout` at most
        group = dist.new_group(backend=name, timeout=delta)
        store = dist.PrefixStore(f"{run_id}/k3", base)
        return cls(rank, world, store, timeout, device, group, owns_group)

    def close(self) -> None:
        if not dist.is_initialized():
            return
        if self.owns_group:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(self.group)

    # ---- failure reporting --------------------------------------------------------------------------------
    @contextmanager
    def guard(self) -> Iterator[None]:
        """Post any exception raised inside (but a DistError, which reports another rank) to the store,
        so the ranks waiting for this one in a collective report it instead of a bare timeout."""
        try:
            yield
        except DistError:
            raise
        except BaseException as e:
            self.post_failure(e)
            raise

    def post_failure(self, error: BaseException) -> None:
        last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
        where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
        try:
            if self.store.add(_FAILURES, 1) == 1:
                self.store.set(_FAILED, f"rank {self.rank}: {type(error).__name__}: {error}{where}")
        except Exception:  # the store itself is gone: nothing more to tell
            pass

    def _explain(self, name: str, seq: int, error: Exception) -> DistError:
        try:
            if self.store.check([_FAILED]):
                return DistError(f"{name}: {self.store.get(_FAILED).decode()}")
            late = [r for r in range(self.world) if self.store.add(f"arrived/{r}", 0) < seq]
        except Exception:
            return DistError(f"{name} failed on rank {self.rank} and the rendezvous store is gone: {error}")
        if late:
            ranks = ", ".join(map(str, late))
            return DistError(
                f"{name}: rank {ranks} did not arrive within {self.timeout:g} s "
                f"(collective #{seq}; this is rank {self.rank}): {error}"
            )
        return DistError(f"{name} failed on rank {self.rank} (collective #{seq}): {error}")

    def _call(self, name: str, run: Callable[[], object]) -> None:
        seq = self.store.add(f"arrived/{self.rank}", 1)
        try:
            run()
        except DistError:
            raise
        except Exception as e:  # gloo: RuntimeError on a timeout or a closed peer connection
            raise self._explain(name, seq, e) from e

    # ---- collectives --------------------------------------------------------------------------------------
    def all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.Tensor:
        """Variable-split all-to-all along dim 0: `in_splits[r]` rows go to rank r, `out_splits[r]` come
        from it (in rank order). Returns `out`."""
        self._call(
            "all_to_all",
            lambda: dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=self.group),
        )
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's `t` (same shape on every rank), in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        self._call("all_gather", lambda: dist.all_gather(parts, t.contiguous(), group=self.group))
        return torch.stack(parts)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self._call("all_reduce", lambda: dist.all_reduce(t, group=self.group))
        return t

    def barrier(self) -> None:
        self.all_reduce_(torch.zeros(1, device=self.device))
