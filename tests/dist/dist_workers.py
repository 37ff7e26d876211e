"""Functions that run on every rank of a test (see dist_ranks.py); each compares against a one-process
reference that every rank computes for itself from the same seeds, and raises on any difference."""

from __future__ import annotations

import copy

import torch

from k3.config import K3Config
from k3.dist.group import Comm
from k3.dist.moe import ExpertParallel
from k3.dist.transport import exchange


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.double().norm())
    return float((a.double() - b.double()).norm()) / (scale if scale > 0 else 1.0)


def check_close(name: str, got: torch.Tensor, want: torch.Tensor, bitwise: bool, rel: float = 1e-6) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if bitwise and not torch.equal(got, want):
        raise AssertionError(f"{name}: not bitwise equal (relative error {relative_error(got, want):.3g})")
    if relative_error(got, want) > rel:
        raise AssertionError(f"{name}: relative error {relative_error(got, want):.3g} > {rel}")


# ---- transport ------------------------------------------------------------------------------------------
def exchange_is_a_permutation(comm: Comm, splits: list[list[int]]) -> None:
    """splits[s][h] rows go from s to h. Every row is tagged (source, row); forward and backward against
    the permutation computed locally."""
    R, s = comm.world, comm.rank
    tagged = [
        torch.tensor([[src * 1000.0 + i, float(src)] for i in range(sum(splits[src]))]).view(-1, 2)
        for src in range(R)
    ]
    rows = tagged[s].clone().requires_grad_(True)
    (got,) = exchange(comm, [(rows, splits[s], [splits[src][s] for src in range(R)])])

    def block(src: int, h: int) -> torch.Tensor:
        start = sum(splits[src][:h])
        return tagged[src][start : start + splits[src][h]]

    want = torch.cat([block(src, s) for src in range(R)]).view(-1, 2)
    if not torch.equal(got.detach(), want):
        raise AssertionError(f"rank {s} received {got.tolist()}, expected {want.tolist()}")
    # backward: host h weighs what it received by (h + 1) * tag, the gradient at source s must be exactly that
    (got * (s + 1) * want).sum().backward()
    grad_want = torch.cat([(h + 1) * block(s, h) for h in range(R)]).view(-1, 2)
    if not torch.equal(rows.grad, grad_want):
        raise AssertionError(f"rank {s}: gradient {rows.grad.tolist()} != {grad_want.tolist()}")


# ---- the MoE dispatch -----------------------------------------------------------------------------------
def _tiny_moe():
    from k3.model import K3ForCausalLM

    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM.from_config(cfg, seed=0, quantized_experts=False)
    return next(layer.block_sparse_moe for layer in model.model.layers if layer.is_moe)


def _pairs(scenario: str, n: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if scenario == "random":
        return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(n)]).view(n, k)
    if scenario == "one_expert":  # top-1, every pair to expert E - 1
        return torch.full((n, 1), E - 1, dtype=torch.long)
    if scenario == "hot":  # expert 0 in every token, the rest random
        rest = torch.stack([torch.randperm(E - 1, generator=gen)[: k - 1] + 1 for _ in range(n)]).view(
            n, k - 1
        )
        return torch.cat([torch.zeros(n, 1, dtype=torch.long), rest], 1)
    raise ValueError(scenario)


def _grads(moe) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in moe.experts.named_parameters()
    }


def dispatch_matches_one_process(
    comm: Comm, sizes: list[int], scenario: str, policy: str, slots: int, history: bool, bitwise: bool
) -> None:
    """EP dispatch on each rank's slice of a global batch == MoE.dispatch on the whole batch: outputs, the
    gradients of z and of the routing weights (this rank's rows) and every expert's weight gradient (summed
    over ranks); twice, bitwise equal run to run."""
    s = comm.rank
    reference = _tiny_moe()
    E, L = len(reference.experts), reference.experts[0].w1.in_features
    gen = torch.Generator().manual_seed(1234)
    N = sum(sizes)
    k = 1 if scenario == "one_expert" else 2
    z_all = torch.randn(N, L, generator=gen)
    w_all = torch.rand(N, k, generator=gen)
    idx_all = _pairs(scenario, N, E, k, gen)
    g_all = torch.randn(N, L, generator=gen)  # d loss / d output

    z_ref, w_ref = z_all.clone().requires_grad_(True), w_all.clone().requires_grad_(True)
    out_ref = reference.dispatch(z_ref, w_ref, idx_all)
    (out_ref * g_all).sum().backward()
    want_experts = _grads(reference)

    lo, hi = sum(sizes[:s]), sum(sizes[: s + 1])
    runs = []
    for _ in range(2):
        moe = copy.deepcopy(reference)
        moe.zero_grad(set_to_none=True)
        ep = ExpertParallel(comm, policy=policy, slots_per_rank=slots, threshold=False, keep_stats=True)
        if history:  # a uniform history: EPLB gives every expert one replica when slots = E / R
            ep.history[0] = torch.ones(E).numpy()
        ep.attach(moe, 0)
        z, w = z_all[lo:hi].clone().requires_grad_(True), w_all[lo:hi].clone().requires_grad_(True)
        out = moe.dispatch(z, w, idx_all[lo:hi])
        (out * g_all[lo:hi]).sum().backward()
        grads = _grads(moe)
        for name in sorted(grads):
            comm.all_reduce_(grads[name])
        runs.append((out.detach(), z.grad, w.grad, grads, ep.stats[0][-1]))
    out, z_grad, w_grad, grads, stats = runs[0]
    if policy == "moonep" and max(stats.received) - min(stats.received) > 1:
        raise AssertionError(f"moonep: received pairs {stats.received} are not equal to within one")
    # every expert has two copies, and both compute pairs when it has at least two
    duplicated = int((torch.bincount(idx_all.view(-1), minlength=E) >= 2).sum())
    if history and not duplicated <= stats.replicas <= E:
        raise AssertionError(f"forced duplication: {stats.replicas} replicas, expected {duplicated}")
    check_close("output", out, out_ref[lo:hi].detach(), bitwise)
    check_close("grad z", z_grad, z_ref.grad[lo:hi], bitwise)
    check_close("grad weights", w_grad, w_ref.grad[lo:hi], bitwise)
    for name, want in want_experts.items():
        check_close(f"grad experts.{name}", grads[name], want, bitwise)
    again = runs[1]
    for a, b in zip((out, z_grad, w_grad), again[:3], strict=True):
        if not torch.equal(a, b):
            raise AssertionError("run to run: not bitwise equal")
    for name in grads:
        if not torch.equal(grads[name], again[3][name]):
            raise AssertionError(f"run to run: grad experts.{name} differs")


def raises_inside_moe(comm: Comm, bad_rank: int) -> None:
    """`bad_rank` raises in its expert computation; every rank must end with that error."""
    moe = _tiny_moe()
    ExpertParallel(comm).attach(moe, 0)
    if comm.rank == bad_rank:

        def explode(module, args):
            raise RuntimeError("expert 0 exploded on purpose")

        for expert in moe.experts:
            expert.register_forward_pre_hook(explode)
    L = moe.experts[0].w1.in_features
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(16, L, generator=gen)
    idx = torch.stack([torch.randperm(len(moe.experts), generator=gen)[:2] for _ in range(16)])
    for _ in range(3):
        moe.dispatch(z, torch.rand(16, 2, generator=gen), idx)


def silent_rank(comm: Comm, missing: int) -> None:
    """`missing` never enters the collective (it sleeps past the timeout); the others must name it."""
    import time

    if comm.rank == missing:
        time.sleep(comm.timeout + 1)
        return
    comm.all_reduce_(torch.ones(1))


# ---- training -------------------------------------------------------------------------------------------
def train_on_ranks(comm: Comm, config: dict) -> None:
    """`k3 train` as torchrun would run it on this rank (the environment is torchrun's)."""
    from k3.train.trainer import TrainConfig, train

    train(TrainConfig(**config))


# ---- the whole model ------------------------------------------------------------------------------------
def model_logits_match(comm: Comm, preset: str, policy: str, quantized: bool, rows: list[int]) -> None:
    """Logits of K3ForCausalLM with expert-parallel MoE layers, each rank on its `rows[rank]` sequences
    of a global batch, against the one-process model on the whole batch and on the same sequences (1e-6
    relative; bitwise on the whole batch without replicas).

    Sequences of 16 tokens: torch's CPU matmul computes a row differently when the matrix has fewer than
    16 rows (another kernel), so with shorter sequences a rank's dense layers would not compute its rows
    as the whole batch does. An expert's matmul sees the same rows in the same order as in one process
    on the whole batch (sources in rank order), unless a replica splits it."""
    from k3.model import K3ForCausalLM

    cfg = K3Config.preset(preset)
    model = K3ForCausalLM.from_config(cfg, seed=0, quantized_experts=quantized).eval()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, cfg.vocab_size, (sum(rows), 16), generator=gen)
    lo, hi = sum(rows[: comm.rank]), sum(rows[: comm.rank + 1])
    with torch.no_grad():
        whole, mine = model(ids)[lo:hi], model(ids[lo:hi])
        ep = ExpertParallel(comm, policy=policy, slots_per_rank=2, threshold=False, keep_stats=True)
        ep.install(model)
        got = model(ids[lo:hi])
    replicas = sum(s.replicas for layer in ep.stats.values() for s in layer)
    if policy == "moonep" and replicas == 0:
        raise AssertionError("moonep planned no replica: the test would not exercise shipping them")
    check_close(f"{preset} logits ({policy}) vs one process, whole batch", got, whole, bitwise=replicas == 0)
    check_close(f"{preset} logits ({policy}) vs one process, same rows", got, mine, bitwise=False)


def generation_matches_one_process(comm: Comm, policy: str) -> None:
    """Greedy generation of 3 prompts (one rank gets a placeholder round) under EP == one process."""
    from k3.dist.generate import generate, greedy
    from k3.model import K3ForCausalLM

    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM.from_config(cfg, seed=0, quantized_experts=policy == "none").eval()
    prompts = [[5, 9, 13, 2, 7], [11, 3], [8, 8, 4, 1, 6, 2, 9]]
    with torch.no_grad():
        want = [greedy(model, p, 4) for p in prompts]
    ExpertParallel(comm, policy=policy, slots_per_rank=2, threshold=False).install(model)
    got = generate(comm, model, prompts, 4)
    if got != want:
        raise AssertionError(f"expert-parallel generation {got} != one process {want}")
