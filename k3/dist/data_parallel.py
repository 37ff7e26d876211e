"""Data parallelism around the expert-parallel MoE: each rank takes its share of the global batch, the
gradients are summed over ranks, and what balance needs is gathered, so every rank steps the same weights
as one process would on the whole batch.

    par = DataParallel.start(policy="moonep", slots_per_rank=1, timeout=60)   # under torchrun
    model = sharded_model(cfg, seed=0, rank=par.rank, world=par.world)       # k3.dist.shard
    par.install(model)                           # expert-parallel dispatch in every MoE layer
    x = par.shard(inputs)                        # [B / R, T]: rank r's rows r B/R .. (r+1) B/R - 1
    loss = ce_sum(model(x), par.shard(labels)) / counted_in_the_global_batch
    loss.backward(); par.reduce_gradients(model)
    norm = par.clip_gradients(model, max_norm)   # the norm of the whole model's gradient
    scores = par.gather(trace.scores(layer))     # [B T, E] in global row order, for the routing balance

The routed experts are sharded (each rank holds its own, k3.dist.shard) and their gradients are complete
at home (replica gradients come home through the exchange's backward): they are not reduced. Everything
else is replicated and its gradients all-reduced (one flat buffer per dtype). A parameter no rank
produced a gradient for keeps `grad = None`, as in one process (so AdamW leaves it alone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from k3.dist.group import Comm, DistError
from k3.dist.moe import ExpertParallel
from k3.dist.shard import is_expert_name


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

    def gather_micro(self, rows: torch.Tensor, micro: int) -> torch.Tensor:
        """`gather` of rows that hold `micro` micro-batches' shares one after the other ([micro, n, ...]
        flattened): every rank's, in the order of the one-process batch (micro-batch, then rank)."""
        every = self.gather(rows).unflatten(0, (self.world, micro, -1))  # [R, micro, n, ...]
        return every.transpose(0, 1).flatten(0, 2)

    def sum(self, value: float) -> float:
        return float(self.comm.all_reduce_(torch.tensor([value], dtype=torch.float64)).item())

    def reduce_gradients(self, model: nn.Module) -> None:
        """Sum the replicated parameters' gradients over the ranks (the experts' are complete at home)."""
        params = [p for name, p in model.named_parameters() if p.requires_grad and not is_expert_name(name)]
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

    def clip_gradients(self, model: nn.Module, max_norm: float) -> float:
        """`torch.nn.utils.clip_grad_norm_` over the whole (sharded) model: the 2-norm of every gradient
        (replicated ones counted once, by rank 0; experts by their home), every gradient scaled by
        min(1, max_norm / (norm + 1e-6)) as torch does. Returns the norm."""
        mine = [
            p.grad
            for name, p in model.named_parameters()
            if p.grad is not None and (is_expert_name(name) or self.rank == 0)
        ]
        zero = torch.zeros((), dtype=torch.float64)
        squares = torch.nn.utils.get_total_norm(mine).double() ** 2 if mine else zero
        total = self.comm.all_reduce_(squares.reshape(1).to(self.comm.device)).sqrt().float().cpu()[0]
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
        return float(total)

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.comm.close()


def cpu_threads(world: int) -> int:
    """Threads per rank when the ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // world)
