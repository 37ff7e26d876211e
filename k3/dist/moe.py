"""The MoE layer's dispatch under expert parallelism: the latent z of every (token, expert) pair travels to
the rank that computes it, and its output comes home, in pair order.

    ep = ExpertParallel(comm, policy="moonep", slots_per_rank=2)
    ep.install(model)          # every MoE layer's `dispatch` now runs across the ranks
    logits = model(my_rows)    # every rank calls the model, each on its own tokens (any number, even 0)

One layer, one forward (see k3.dist.planner for the plan, k3.dist.transport for the exchange):

1. count the local pairs per expert and gather them: counts [R, E], the same on every rank;
2. every rank derives the same plan; source s sends its pairs host by host, expert by expert
   (rows of z, [pairs, L]); homes send the weights of their replicated experts (w1, w3, w2, flattened);
3. each host regroups what arrived expert by expert (sources in rank order) and runs one matmul per
   expert it hosts: its own experts from its parameters, replicas from the received weights;
4. the outputs go back with the splits swapped, are put in pair order and summed per token with the
   routing weights, exactly as `MoE.dispatch` does in one process.

The experts are the model's own modules; a rank only ever reads the weights of the experts it is home to
(replicas use the shipped copies), and the gradients of replica weights flow back to the home through the
exchange's backward, where they accumulate with the home's own: a home's expert gradients are complete
without any reduction. The model may hold every expert or only this rank's (k3.dist.shard: training
shards them, so a rank holds E / R experts' weights, gradients and optimizer state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from k3.dist.group import Comm
from k3.dist.planner import Plan, PlanError, home_of, plan, worthwhile_pairs
from k3.dist.transport import exchange, segments
from k3.model.moe import MoE, RoutedExpert
from k3.ops.mxfp4 import MXFP4Linear, mxfp4_matmul

_WEIGHTS = ("w1", "w3", "w2")


@dataclass
class LayerStats:
    """What one layer's dispatch did in one forward (this rank's view; counts are global)."""

    received: list[int]  # pairs each rank computed
    replicas: int
    rehomed: int  # pairs computed by a replica
    token_bytes: int  # z rows that left their rank, there and back (forward)
    weight_bytes: int  # replica weights shipped (forward; the same again as gradients in training)
    plan_s: float
    collective_s: float  # counts gathered, pairs dispatched and combined (forward)


STATS_COLUMNS = [
    "step",
    "micro",
    "layer",
    "received_max_over_mean",
    "replicas",
    "rehomed_share",
    "token_bytes",
    "weight_bytes",
    "plan_ms",
    "collective_ms",
]


@dataclass
class ExpertParallel:
    """The expert-parallel dispatch of every MoE layer of a model, over the ranks of `comm`."""

    comm: Comm
    policy: str = "none"
    slots_per_rank: int = 1
    threshold: bool = True  # skip replicas whose saved traffic is below the weight bytes they cost
    history: dict[int, np.ndarray] = field(default_factory=dict)  # eplb: load [E] per layer
    stats: dict[int, list[LayerStats]] = field(default_factory=dict)
    keep_stats: bool = False

    def install(self, model: nn.Module) -> ExpertParallel:
        """Replace the dispatch of every MoE layer of `model` (a K3ForCausalLM) by the expert-parallel one."""
        for layer in model.model.layers:  # type: ignore[union-attr]
            if layer.is_moe:
                self.attach(layer.block_sparse_moe, layer.index)
        return self

    def attach(self, moe: MoE, layer: int) -> None:
        """Replace one MoE layer's dispatch (the instance attribute shadows the method)."""
        home_of(len(moe.experts), self.comm.world)  # E % R == 0, or a clear error
        object.__setattr__(moe, "dispatch", _LayerDispatch(self, moe, layer))

    def stats_rows(self, step: int) -> list[dict]:
        """The kept stats as rows (STATS_COLUMNS), one per layer and forward since the last call, which
        clears them."""
        rows = []
        for layer, calls in sorted(self.stats.items()):
            for micro, s in enumerate(calls):
                mean = sum(s.received) / len(s.received)
                rows.append(
                    {
                        "step": step,
                        "micro": micro,
                        "layer": layer,
                        "received_max_over_mean": f"{max(s.received) / mean if mean else 1.0:.6f}",
                        "replicas": s.replicas,
                        "rehomed_share": f"{s.rehomed / max(1, sum(s.received)):.6f}",
                        "token_bytes": s.token_bytes,
                        "weight_bytes": s.weight_bytes,
                        "plan_ms": f"{1e3 * s.plan_s:.3f}",
                        "collective_ms": f"{1e3 * s.collective_s:.3f}",
                    }
                )
        self.stats.clear()
        return rows


def _shipped(expert: RoutedExpert) -> list[torch.Tensor]:
    """What a replica of `expert` needs: the weights of w1, w3, w2, or (MXFP4) their packed codes and
    scales, which travel as they are (uint8, 4.25 bits per weight)."""
    tensors = []
    for name in _WEIGHTS:
        linear = getattr(expert, name)
        packed = isinstance(linear, MXFP4Linear)
        tensors += [linear.weight_packed, linear.weight_scale] if packed else [linear.weight]
    if len({t.dtype for t in tensors}) != 1:
        raise PlanError("an expert mixes MXFP4 and plain matrices: its replicas cannot be shipped")
    return tensors


def _run_replica(template: RoutedExpert, flat: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """`w2(act(w1 z, w3 z))` with the weights unpacked from `flat` (shipped from the expert's home);
    `template` is an expert of the same layer (shapes, format, activation)."""
    shapes = [t.shape for t in _shipped(template)]
    parts = iter(t.view(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes, strict=True))
    linears = []
    for name in _WEIGHTS:
        if isinstance(getattr(template, name), MXFP4Linear):
            packed, scale = next(parts), next(parts)
            linears.append(lambda x, packed=packed, scale=scale: mxfp4_matmul(x, packed, scale, None))
        else:
            weight = next(parts)
            linears.append(lambda x, weight=weight: F.linear(x, weight.to(x.dtype)))
    w1, w3, w2 = linears
    return w2(template.act(w1(z), w3(z)))


class _LayerDispatch:
    """`MoE.dispatch(z, weights, indices)` for one layer, across the ranks."""

    def __init__(self, ep: ExpertParallel, moe: MoE, layer: int) -> None:
        self.ep, self.moe, self.layer = ep, moe, layer
        E, R = len(moe.experts), ep.comm.world
        self.homes = home_of(E, R)
        # every expert of a layer has the same shapes and format: a home one stands for them all
        self.template = moe.experts[int(np.flatnonzero(self.homes == ep.comm.rank)[0])]
        shipped = _shipped(self.template)
        self.weight_numel = sum(t.numel() for t in shipped)
        self.weight_bytes = sum(t.numel() * t.element_size() for t in shipped)
        self.weight_dtype = shipped[0].dtype
        self.latent = self.template.w1.in_features

    def plan(self, counts: np.ndarray, elem_bytes: int) -> Plan:
        min_pairs = (
            worthwhile_pairs(self.weight_bytes, 2 * self.latent * elem_bytes) if self.ep.threshold else 0
        )
        return plan(
            counts,
            self.ep.slots_per_rank,
            self.ep.policy,
            history=self.ep.history.get(self.layer),
            min_pairs=min_pairs,
        )

    def __call__(self, z: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        comm, experts = self.ep.comm, self.moe.experts
        s, R, E = comm.rank, comm.world, len(experts)
        N, k = indices.shape
        began = time.perf_counter()
        flat = indices.reshape(-1)  # pair j = (token j // k, expert flat[j])
        order = flat.argsort(stable=True)  # local pairs grouped by expert
        local = torch.bincount(flat, minlength=E)  # [E]
        counts = comm.all_gather(local.to(comm.device)).cpu().numpy()  # [R, E]
        gathered = time.perf_counter()
        p = self.plan(counts, z.element_size())
        planned = time.perf_counter()
        route = torch.from_numpy(p.route)  # [R, E, R]

        # 1. what this rank sends: for host h, for expert e, the next chunk of its e-pairs
        mine = route[s]  # [E, R]
        expert_start = torch.cumsum(local, 0) - local  # [E] where e's pairs begin in `order`
        within = torch.cumsum(mine, 1) - mine  # [E, R] where host h's chunk begins among them
        send_pos = segments((expert_start[:, None] + within).t().reshape(-1), mine.t().reshape(-1))
        send_pairs = order[send_pos]  # [pairs] pair ids in send order (a permutation of all pairs)
        send_rows = z[send_pairs // k]  # [pairs, L]
        send_splits, recv_splits = mine.sum(0).tolist(), route[:, :, s].sum(1).tolist()

        # replica weights: home -> host, in (host, expert) order on both sides
        outgoing = [(e, h) for e, h in p.replicas if self.homes[e] == s]
        incoming = [(e, h) for e, h in p.replicas if h == s]
        if self.moe.load_experts is not None:  # loaded from a URL: read the home experts used here first
            used = {e for e, c in enumerate(route[:, :, s].sum(0).tolist()) if c and self.homes[e] == s}
            self.moe.load_experts(torch.tensor(sorted(used | {e for e, _ in outgoing}), dtype=torch.long))
        n = self.weight_numel
        w_send = [n * sum(1 for _, h in outgoing if h == r) for r in range(R)]
        w_recv = [n * sum(1 for e, _ in incoming if self.homes[e] == r) for r in range(R)]
        parts = [t.reshape(-1) for e, _ in outgoing for t in _shipped(experts[e])]
        send_w = torch.cat(parts) if parts else torch.zeros(0, dtype=self.weight_dtype, device=z.device)
        sent = time.perf_counter()
        recv_rows, recv_w = exchange(comm, [(send_rows, send_splits, recv_splits), (send_w, w_send, w_recv)])
        arrived = time.perf_counter()

        # 2. compute: regroup by expert (sources in rank order), one matmul per hosted expert
        got = route[:, :, s]  # [R, E] chunk sizes, received in (source, expert) order
        src_start = (torch.cumsum(got.reshape(-1), 0) - got.reshape(-1)).view(R, E)
        by_expert = segments(src_start.t().reshape(-1), got.t().reshape(-1))  # expert-major order
        rows = recv_rows[by_expert]
        replica_weights = dict(
            zip([e for e, _ in incoming], recv_w.split(n) if incoming else [], strict=True)
        )
        here = got.sum(0).tolist()  # [E] rows of each expert on this rank
        host_out = None
        if not incoming and self.moe.fast_decode and not torch.is_grad_enabled():
            # the hosted experts in one native call, decided on the whole batch's busiest expert as one
            # process decides: then each row's value is the one process's, bit for bit
            starts = [0, *np.cumsum(here).tolist()]
            host_out = self.moe.experts_over_rows(rows, starts, int(counts.sum(0).max()))
        if host_out is None:
            outputs, start = [], 0
            for e, count in enumerate(here):
                if count:
                    chunk = rows[start : start + count]
                    if self.homes[e] == s:
                        outputs.append(experts[e](chunk))
                    else:
                        outputs.append(_run_replica(self.template, replica_weights[e], chunk))
                    start += count
            # rows * 0 keeps an empty host attached to the graph, so it joins every backward collective too
            host_out = torch.cat(outputs) if outputs else rows * 0
        back_out = host_out[torch.argsort(by_expert)]  # (source, expert) order, as received

        # 3. combine: home again, in send order, then pair order
        combined = time.perf_counter()
        (home_rows,) = exchange(comm, [(back_out, recv_splits, send_splits)])
        collective_s = (gathered - began) + (arrived - sent) + (time.perf_counter() - combined)
        pair_out = home_rows[torch.argsort(send_pairs)]  # [N*k, L]
        if self.ep.keep_stats:
            self._record(p, z.element_size(), planned - gathered, collective_s)
        return torch.einsum("nkl,nk->nl", pair_out.view(N, k, z.shape[-1]), weights.to(z.dtype))

    def _record(self, p: Plan, elem: int, plan_s: float, collective_s: float) -> None:
        E = p.route.shape[1]
        stats = LayerStats(
            received=p.received().tolist(),
            replicas=len(p.replicas),
            rehomed=p.rehomed_pairs(E // p.ranks),
            token_bytes=2 * p.remote_pairs() * self.latent * elem,
            weight_bytes=len(p.replicas) * self.weight_bytes,
            plan_s=plan_s,
            collective_s=collective_s,
        )
        self.ep.stats.setdefault(self.layer, []).append(stats)
