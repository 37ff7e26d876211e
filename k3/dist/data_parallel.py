"""Data parallelism around the expert-parallel MoE: each rank takes its share of the global batch, the
gradients are summed over ranks, and what balance needs is gathered, so every rank steps the same weights
as one process would on the whole batch.

    par = DataParallel.start(policy="moonep", slots_per_rank=1, timeout=60)   # under torchrun
    par.install(model)                           # expert-parallel dispatch in every MoE layer
    x = par.shard(inputs)                        # [B / R, T]: rank r's rows r B/R .. (r+1) B/R - 1
    loss = ce_sum(model(x), par.shard(labels)) / counted_in_the_global_batch
    loss.backward(); par.reduce_gradients(model)
    scores = par.gather(trace.scores(layer))     # [B T, E] in global row order, for the routing balance

Dense weights are replicated and their gradients all-reduced (one flat buffer per dtype); expert
gradients are summed the same way, which gives every rank the home's gradient (only homes hold one).
A parameter no rank produced a gradient for keeps `grad = None`, as in one process (so AdamW leaves it
alone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from k3.dist.group import Comm, DistError
from k3.dist.moe import ExpertParallel


@dataclass
class DataParallel:
    comm: Comm
    ep: ExpertParallel

    @classmethod
    def start(
        cls, policy: str = "none", slots_per_rank: int = 1, timeout: float = 60.0, threshold: bool = True
    ) -> DataParallel:
        comm = Comm.from_env(timeout=timeout, backend="gloo")  # k3 trains on the CPU
        ep = ExpertParallel(comm, policy=policy, slots_per_rank=slots_per_rank, threshold=threshold)
        ep.keep_stats = True
        return cls(comm, ep)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world(self) -> int:
        return self.comm.world

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run's files (rank 0)."""
        return self.comm.rank == 0

    def install(self, model: nn.Module) -> None:
        self.ep.install(model)

    def shard(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch [B, ...] (B must divide evenly)."""
        B, R = batch.shape[0], self.world
        if B % R:
            raise DistError(f"--batch-size {B} does not divide evenly over {R} processes")
        return batch[self.rank * (B // R) : (self.rank + 1) * (B // R)]

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's `rows` [n, ...] (the same n everywhere) concatenated in rank order: [R n, ...]."""
        return self.comm.all_gather(rows.to(self.comm.device)).flatten(0, 1).to(rows.device)

    def sum(self, value: float) -> float:
        return float(self.comm.all_reduce_(torch.tensor([value], dtype=torch.float64)).item())

    def reduce_gradients(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        self.comm.all_reduce_(has)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p, flag in zip(params, has.tolist(), strict=True):
            if flag:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            self.comm.all_reduce_(flat)
            for p, g in zip(group, flat.split([p.numel() for p in group]), strict=True):
                p.grad.copy_(g.view_as(p.grad))

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.comm.close()


def cpu_threads(world: int) -> int:
    """Threads per rank when the ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // world)
