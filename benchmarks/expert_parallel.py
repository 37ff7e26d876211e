"""Expert parallelism: how evenly the planned pairs land per rank, what travels, and what a step costs.

    python benchmarks/expert_parallel.py plan       # planned figures: trained mini loads + a skewed router
    python benchmarks/expert_parallel.py project    # K3 scale (896 experts, 16 active): R = 8, 16, 64
    python benchmarks/expert_parallel.py step       # a training step on 1, 2, 4 processes (torchrun): time
                                                    # (compute, collectives), parameter/optimizer/RSS MB

`plan` replays the per-step, per-layer expert loads a trained mini run wrote (benchmarks/results/
train_balance_accum32_runs/{none,qb}/loads.csv: 65k tokens per step) and a synthetic Zipf-skewed router
through `k3.dist.planner.plan` for none / eplb / moonep at R = 2, 4, 8. The loads are global per expert;
each source rank is given an equal share of every expert's pairs (the runs did not record which sequence
went where), which is what an even split of the batch gives on average. EPLB replans every 2 steps from
the loads of the 2 steps before (no replicas before the first placement); MoonEP plans every step from
that step's counts. Slots: 1 replica per rank and layer. The replica threshold is on (a replica must carry
at least the pairs whose z traffic equals its weights).

Bytes per step (fp32 for mini as trained, bf16 for the K3 projection), forward + backward:
  tokens  = 2 (there and back) x 2 (forward, backward) x remote pairs x L x bytes
  weights = replicas x 3 L m x bytes x 2 (weights out, gradients back)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3.dist.planner import plan, worthwhile_pairs  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MINI_RUNS = RESULTS / "train_balance_accum32_runs"
REPLAN = 2  # eplb: steps between placements (the mini runs hold only a few steps)


def read_loads(path: Path) -> dict[int, dict[int, np.ndarray]]:
    """{step: {layer: loads [E]}} from a run's loads.csv."""
    steps: dict[int, dict[int, np.ndarray]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            loads = np.array([int(float(v)) for k, v in row.items() if k.startswith("e")], dtype=np.int64)
            steps.setdefault(int(row["step"]), {})[int(row["layer"])] = loads
    return steps


def synthetic_loads(E: int, k: int, tokens: int, steps: int, layers: int, skew: float, seed: int = 0):
    """A router whose expert popularity follows Zipf(skew) (a random order per layer), k pairs per token."""
    rng = np.random.default_rng(seed)
    out: dict[int, dict[int, np.ndarray]] = {}
    popularity = {}
    for layer in range(layers):
        p = 1.0 / np.arange(1, E + 1) ** skew
        popularity[layer] = rng.permutation(p / p.sum())
    for step in range(1, steps + 1):
        out[step] = {layer: rng.multinomial(tokens * k, popularity[layer]) for layer in range(layers)}
    return out


def source_counts(load: np.ndarray, R: int) -> np.ndarray:
    """[R, E]: every expert's pairs split as evenly as possible over the R source ranks."""
    return np.stack([load // R + (r < load % R) for r in range(R)]).astype(np.int64)


def plan_figures(loads, R: int, policy: str, L: int, m: int, elem: int, slots: int = 1) -> dict:
    weight = 3 * L * m
    min_pairs = worthwhile_pairs(weight * elem, 2 * L * elem)
    steps = sorted(loads)
    layers = sorted(loads[steps[0]])
    ratios, replicas, rehomed, token_bytes, weight_bytes, plan_s = [], [], [], [], [], []
    for step in steps:
        t_tokens = t_weights = 0
        for layer in layers:
            history = None
            if policy == "eplb":
                placed = (step - 1) - (step - 1) % REPLAN  # steps 1..placed are known at the last placement
                window = [s for s in range(placed - REPLAN + 1, placed + 1) if s in loads]
                history = sum(loads[s][layer] for s in window) / len(window) if window else None
            counts = source_counts(loads[step][layer], R)
            began = time.perf_counter()
            p = plan(counts, slots, policy, history=history, min_pairs=min_pairs)
            plan_s.append(time.perf_counter() - began)
            received = p.received()
            ratios.append(received.max() / received.mean())
            replicas.append(len(p.replicas))
            rehomed.append(p.rehomed_pairs(counts.shape[1] // R) / counts.sum())
            t_tokens += 2 * 2 * p.remote_pairs() * L * elem
            t_weights += 2 * len(p.replicas) * weight * elem
        token_bytes.append(t_tokens)
        weight_bytes.append(t_weights)
    return {
        "R": R,
        "policy": policy,
        "max_over_mean_mean": float(np.mean(ratios)),
        "max_over_mean_worst": float(np.max(ratios)),
        "replicas_per_layer": float(np.mean(replicas)),
        "rehomed_share": float(np.mean(rehomed)),
        "token_MB_per_step": float(np.mean(token_bytes)) / 1e6,
        "weight_MB_per_step": float(np.mean(weight_bytes)) / 1e6,
        "planner_ms_per_layer": 1e3 * float(np.mean(plan_s)),
    }


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


def cmd_plan(args) -> None:
    from k3.config import K3Config

    cfg = K3Config.preset("mini")
    L, m, E, k = cfg.expert_input_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_token
    sources = {
        f"mini {name} (trained)": read_loads(MINI_RUNS / name / "loads.csv") for name in ("none", "qb")
    }
    tokens = int(next(iter(sources.values()))[1][1].sum()) // k
    sources["synthetic Zipf 1.0"] = synthetic_loads(E, k, tokens, 32, 8, skew=1.0)
    out = []
    for name, loads in sources.items():
        rows = [
            plan_figures(loads, R, policy, L, m, elem=4)
            for R in (2, 4, 8)
            for policy in ("none", "eplb", "moonep")
        ]
        print_table(rows, f"{name}: {len(loads)} steps x {len(loads[1])} layers, {tokens} tokens per step")
        out += [{"loads": name, **row} for row in rows]
    write_csv(RESULTS / "expert_parallel_plan.csv", out)


def cmd_project(args) -> None:
    """K3 (896 experts, top-16, latent 3584, expert width 3072), bf16, the same formulas, per MoE layer."""
    from k3.config import K3Config

    cfg = K3Config.preset("k3")
    L, m, E, k = cfg.expert_input_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_token
    moe_layers = sum(1 for p in cfg.layer_plan if p.ffn.name != "DENSE")
    out = []
    for R in (8, 16, 64):
        tokens = 8192 * R  # 8k tokens per rank per micro-batch
        loads = synthetic_loads(E, k, tokens, 3, 2, skew=1.0, seed=1)
        for policy in ("none", "moonep"):
            row = plan_figures(loads, R, policy, L, m, elem=2)
            row["tokens_per_rank"] = 8192
            row["token_GB_per_step_all_layers"] = row["token_MB_per_step"] / 2 * moe_layers / 1e3
            row["weight_GB_per_step_all_layers"] = row["weight_MB_per_step"] / 2 * moe_layers / 1e3
            out.append(row)
    print_table(
        out, f"K3 projection: {E} experts, top-{k}, {moe_layers} MoE layers, synthetic Zipf 1.0, bf16"
    )
    write_csv(RESULTS / "expert_parallel_k3_projection.csv", out)


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {path.relative_to(ROOT)}")


# ---- measured step time ----------------------------------------------------------------------------------
def _rss_mb() -> float:
    """This process's resident set now (MB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def step_worker(preset: str, batch: int, seq: int, steps: int, policy: str, out: str) -> None:
    """One rank (or the one process): a training step of `preset` on the global batch (forward, backward,
    gradient reduction and norm, AdamW), timed; the routed experts sharded over the ranks."""
    import torch
    import torch.nn.functional as F

    from k3.config import K3Config
    from k3.dist.data_parallel import DataParallel
    from k3.dist.group import torchrun_env
    from k3.dist.shard import sharded_model
    from k3.model import K3ForCausalLM
    from k3.train.optim import build_optimizer

    torch.set_num_threads(1)
    cfg = K3Config.preset(preset)
    par = DataParallel.start(policy, 1, 120.0) if torchrun_env() else None
    if par is None:
        model = K3ForCausalLM.from_config(cfg, seed=0, quantized_experts=False)
    else:
        model = sharded_model(cfg, seed=0, rank=par.rank, world=par.world, quantized_experts=False)
        par.install(model)
        par.ep.keep_stats = True
    optimizer = build_optimizer(model, "adamw", 1e-4, 0.1, (0.9, 0.95))
    gen = torch.Generator().manual_seed(0)
    times, collectives = [], []
    for step in range(steps + 1):  # the first step warms up
        ids = torch.randint(1, cfg.vocab_size, (batch, seq + 1), generator=gen)
        x, y = ids[:, :-1], ids[:, 1:]
        if par is not None:
            x, y = par.shard(x), par.shard(y)
            par.ep.stats.clear()
        began = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / (batch * seq)
        loss.backward()
        comm_s = 0.0
        if par is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            t = time.perf_counter()
            par.reduce_gradients(model)
            par.clip_gradients(model, 1.0)
            comm_s += time.perf_counter() - t
            comm_s += sum(s.collective_s for layer in par.ep.stats.values() for s in layer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - began)
            collectives.append(comm_s)
    state = optimizer.state_dict()["state"].values()
    figures = [
        float(np.median(times)),
        float(np.median(collectives)),
        sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
        sum(t.numel() * t.element_size() for entry in state for t in entry.values()) / 2**20,
        _rss_mb(),
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # peak, this rank
    ]
    names = ["step_s", "collective_s", "param_mb", "optimizer_mb", "rss_mb", "peak_rss_mb"]
    every = torch.tensor([figures], dtype=torch.float64)
    if par is not None:  # every rank's figures: the slowest step, the largest memory
        every = par.comm.all_gather(every[0])
    row = {name: float(every[:, i].max()) for i, name in enumerate(names)}
    if par is None or par.rank == 0:
        Path(out).write_text(json.dumps(row))
    if par is not None:
        par.close()


def cmd_step(args) -> None:
    rows = []
    for R in args.ranks:
        out = RESULTS / f".ep_step_R{R}.json"
        worker = [
            str(Path(__file__)),
            "worker",
            args.preset,
            str(args.batch),
            str(args.seq),
            str(args.steps),
            args.policy,
            str(out),
        ]
        load = os.getloadavg()[0]
        if R == 1:
            subprocess.run([sys.executable, *worker], check=True)
        else:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={R}",
                    *worker,
                ],
                check=True,
            )
        got = json.loads(out.read_text())
        out.unlink()
        rows.append(
            {
                "R": R,
                "preset": args.preset,
                "policy": args.policy if R > 1 else "-",
                "batch": args.batch,
                "seq": args.seq,
                **got,
                "compute_s": got["step_s"] - got["collective_s"],
                "load_avg": load,
            }
        )
    print_table(rows, "measured training step (median), 1 thread per process; memory: the largest rank")
    write_csv(RESULTS / "expert_parallel_step.csv", rows)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        preset, batch, seq, steps, policy, out = sys.argv[2:8]
        step_worker(preset, int(batch), int(seq), int(steps), policy, out)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan")
    sub.add_parser("project")
    step = sub.add_parser("step")
    step.add_argument("--preset", default="mini")
    step.add_argument("--batch", type=int, default=8)
    step.add_argument("--seq", type=int, default=64)
    step.add_argument("--steps", type=int, default=3)
    step.add_argument("--policy", default="moonep")
    step.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    {"plan": cmd_plan, "project": cmd_project, "step": cmd_step}[args.command](args)


if __name__ == "__main__":
    main()
