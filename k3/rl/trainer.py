"""The RL loop: rollouts through the engine, verifiable rewards, K2 / GRPO / ReST updates, weight swap.

One iteration (policy version v = the iteration number, engine and trainer hold the same weights):

1. new prompts (`prompts` less the groups still in the replay buffer, so at most `prompts` groups are
   in flight; a pure function of (seed, iteration)), K samples each, join the unfinished trajectories of
   the replay buffer; the engine continues all of them by one segment
   (`partial_budget` tokens at most, or to the end) with weights v (a task with a tool: each tool call
   answered with token ids of loss mask 0 and the model's next turn generated, k3.tasks.task.Tool);
2. groups whose K samples have all finished are graded (task reward, length penalty, truncation
   penalty); at most `partial_cap` x prompts x K of the batch's samples may come from partial rollouts,
   the rest of those groups wait for the next iteration;
3. the trainer runs one teacher-forced forward over the batch with its own routing: the log row records
   mean/max |trainer - engine| log-prob over the tokens version v drew and the share of positions whose
   experts differ from the engine's (the consistency check); with `routing_replay` the update runs with
   the rollout's experts (route_with);
4. `minibatches` optimizer steps on the loss (k2, grpo or rest; + `ptx_coef` x the PTX cross-entropy,
   k3.rl.ptx), the learning rate warmed up linearly over the run's first `warmup` steps; tokens older
   than `stale_versions` versions are masked (`stale=mask`) or weighted by min(pi_old / pi_behaviour,
   tis_cap) (`stale=tis`);
5. KL(pi_v || pi_v+1) on the batch (k3 estimator), then the engine loads weights v + 1.

A run folder: RUN/rl.json (the config; a rerun must agree), RUN/log.csv (row 0: the base model's held-out
accuracy, greedy and sampled; then one row per iteration), RUN/checkpoints/step-N (model, optimizer, RNG
and the replay buffer: k3.train.state), RUN/config.json. Everything random is seeded by (seed,
iteration, group, sample, position), so a run killed at any point and rerun gives the same log (timing
columns aside) and the same weights.
"""

from __future__ import annotations

import copy
import csv
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from k3.rl.config import RESUMABLE_CHANGES, RLConfig, RLError  # (trainer's names, kept)
from k3.rl.evaluation import held_out_accuracy
from k3.rl.losses import grpo_loss, k2_loss, kl_estimate, rest_loss, shape_rewards
from k3.rl.policy import check_consistency, forward_logprobs, pack
from k3.rl.rollout import Trajectory, generate
from k3.tasks.codec import CharCodec
from k3.tasks.registry import make_task
from k3.tasks.task import Problem, Task
from k3.train.schedule import rl_rate

RL_JSON = "rl.json"
LOG_FILE = "log.csv"
COLUMNS = [
    "step", "loss", "lr", "reward", "score", "eval_acc", "eval_sampled", "response_len", "truncated",
    "partial_share", "buffered", "kl", "logprob_diff_mean", "logprob_diff_max", "expert_flips", "grad_norm",
    "samples", "gen_tokens", "tokens_per_s", "elapsed_s",
]  # fmt: skip
TIMING = ("tokens_per_s", "elapsed_s")  # the columns a resumed run may not reproduce


def task_of(rc: RLConfig) -> Task:
    bases = {n.partition("@")[0] for n in rc.task.split("+")}  # `arithmetic@long`, `arithmetic+sort`
    options = {"digits": rc.digits} if bases & {"arithmetic", "arithmetic-either", "calculator"} else {}
    return make_task(rc.task, held_out_size=rc.held_out, **options)


def _evaluate(engine, task: Task, codec: CharCodec, rc: RLConfig) -> dict:
    """The log's held-out columns: greedy accuracy, and accuracy of 4 samples per problem at the rollout
    temperature."""
    return {
        "eval_acc": f"{held_out_accuracy(engine, task, codec, rc.seed):.6f}",
        "eval_sampled": f"{held_out_accuracy(engine, task, codec, rc.seed, rc.temperature, 4):.6f}",
    }


def _optimizer(model, rc: RLConfig):
    from k3.train.optim import build_optimizer

    return build_optimizer(model, "adamw", rc.lr, 0.0, (0.9, 0.95))


def learning_rate(rc: RLConfig, step: int) -> float:
    """The learning rate of the optimizer's `step`-th update (0-based): k3.train.schedule.rl_rate, a linear
    warm-up over `warmup` steps, then constant."""
    return rl_rate(step, rc.lr, rc.warmup)


def select_batch(pool: list[Trajectory], max_partial: int) -> tuple[list[list[Trajectory]], list[Trajectory]]:
    """(groups to train on now, trajectories to keep): every complete group without partial samples, and
    complete groups with partial ones, oldest first, while their partial samples number at most
    `max_partial` (at least one such group when nothing else is ready, so no group waits for ever)."""
    by_group: dict[int, list[Trajectory]] = {}
    for t in pool:
        by_group.setdefault(t.group, []).append(t)
    complete = [sorted(g, key=lambda t: t.sample) for g in by_group.values() if all(t.finished for t in g)]
    chosen = [g for g in complete if not any(t.partial for t in g)]
    n_partial = 0
    for g in sorted((g for g in complete if any(t.partial for t in g)), key=lambda g: g[0].group):
        share = sum(t.partial for t in g)
        if n_partial + share <= max_partial or not chosen:
            chosen.append(g)
            n_partial += share
    taken = {g[0].group for g in chosen}
    return sorted(chosen, key=lambda g: g[0].group), [t for t in pool if t.group not in taken]


def _token_tensor(trajs: list[Trajectory], T: int, values: Callable[[Trajectory], list]) -> torch.Tensor:
    out = torch.zeros(len(trajs), T, dtype=torch.float64)
    for b, t in enumerate(trajs):
        v = values(t)
        out[b, : len(v)] = torch.tensor(v, dtype=torch.float64)
    return out


def update(model, optimizer, rc: RLConfig, groups: list[list[Trajectory]], rewards: torch.Tensor, scores,
           version: int, old_logp: torch.Tensor, first_step: int = 0,
           ptx: Callable[[int], torch.Tensor] | None = None) -> tuple[float, float]:  # fmt: skip
    """`minibatches` optimizer steps over the batch, the first one the optimizer's `first_step`-th (for the
    warm-up); `ptx(n)`, the weighted PTX term of the iteration's n-th step, is added to the loss (k3.rl.ptx).
    Returns (mean loss, last gradient norm)."""
    trajs = [t for g in groups for t in g]
    K, M = rc.samples, rc.minibatches
    per = max(1, math.ceil(len(groups) / M))
    losses, norm = [], 0.0
    for n, start in enumerate(range(0, len(groups), per)):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(rc, first_step + n)
        rows = slice(start * K, (start + len(groups[start : start + per])) * K)
        chunk = trajs[rows]
        packed = pack(chunk)
        T = packed.mask.shape[1]
        logp = forward_logprobs(model, chunk, rc.temperature, rc.routing_replay, packed)  # [n, T]
        old = old_logp[rows, :T].to(logp.dtype)
        mask = packed.mask.clone()
        versions = _token_tensor(chunk, T, lambda t: t.versions)
        stale = (version - versions > rc.stale_versions) & (mask > 0)
        weights = None
        if rc.stale == "mask":
            mask[stale] = 0.0
        else:
            behaviour = _token_tensor(chunk, T, lambda t: t.logprobs).to(logp.dtype)
            ratio = torch.exp(old - behaviour).clamp(max=rc.tis_cap)
            weights = torch.where(stale, ratio, torch.ones_like(ratio))
        r = rewards[rows].to(logp.dtype)
        if rc.loss == "k2":
            loss = k2_loss(logp, old, mask, r, K, rc.tau, weights)
        elif rc.loss == "grpo":
            loss = grpo_loss(logp, old, mask, r, K, rc.clip, weights)
        else:
            loss = rest_loss(logp, mask, scores[rows] > 0.5)
        if ptx is not None:
            loss = loss + ptx(n)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), rc.grad_clip or math.inf))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return sum(losses) / len(losses), norm


def train_rl(rc: RLConfig, on_iteration: Callable[[dict], None] | None = None) -> Path:
    """Run (or resume) the RL run `rc` describes; returns the run folder."""
    from k3.engine.generate import Engine
    from k3.rl.policy_io import load_policy
    from k3.train.state import (
        cut_log,
        list_checkpoints,
        load_training_state,
        save_training_state,
        write_run_config,
    )

    rc.check()
    run = Path(rc.out)
    if rc.threads:
        torch.set_num_threads(rc.threads)
    task = task_of(rc)
    model = load_policy(rc.init, rc.seed)
    model.train()
    if not model.routers() and rc.routing_replay:
        raise RLError("--routing-replay: the model has no MoE layers")
    codec = CharCodec(model.config.vocab_size)
    ptx_ids = None  # the PTX text file's ids, read once
    if rc.ptx_coef:
        from k3.rl.ptx import ptx_text

        ptx_ids = ptx_text(rc, codec)
    # written only once the policy, the task and the PTX data are known good: a failed start leaves no folder
    write_run_config(rc, run / RL_JSON, RESUMABLE_CHANGES, RLError)
    model.config.save(run / "config.json")
    optimizer = _optimizer(model, rc)
    start, pool, problems, samples_done, elapsed = 0, [], {}, 0, 0.0
    checkpoints = list_checkpoints(run)
    if checkpoints:
        meta = load_training_state(checkpoints[-1][1], model, optimizer)
        start, samples_done, elapsed = meta["step"], meta["samples"], meta["elapsed_s"]
        pool = [Trajectory.from_json(d) for d in meta["pool"]]
        problems = {int(k): Problem(**v) for k, v in meta["problems"].items()}
    engine = Engine(copy.deepcopy(model).eval(), max_batch=rc.max_batch)
    engine.policy_version = start
    log_path = run / LOG_FILE
    cut_log(log_path, COLUMNS, start)
    last = rc.iterations if rc.stop_after is None else min(rc.iterations, rc.stop_after)
    record = bool(model.routers())
    with log_path.open("a", newline="") as log_file:
        writer = csv.DictWriter(log_file, fieldnames=COLUMNS)
        if start == 0:
            writer.writerow({"step": 0, **_evaluate(engine, task, codec, rc)})
            log_file.flush()
        for it in range(start, last):
            began = time.perf_counter()
            version = it
            waiting = len({t.group for t in pool})  # groups carried over count against the batch
            for p, problem in enumerate(task.problems(rc.seed, it, max(0, rc.prompts - waiting))):
                gid = it * rc.prompts + p
                problems[gid] = problem
                pool += [Trajectory(gid, k, task.prompt_ids(problem, codec)) for k in range(rc.samples)]
            gen_tokens = generate(
                engine,
                pool,
                seed=rc.seed,
                temperature=rc.temperature,
                stop_id=task.stop_id(codec),
                max_tokens=task.max_tokens,
                budget=rc.partial_budget or None,
                loop_repeats=rc.loop_repeats,
                record_experts=record,
                tool=task.tool(codec),
            )
            groups, pool = select_batch(pool, int(rc.partial_cap * rc.prompts * rc.samples))
            row: dict = {
                "step": it + 1,
                "lr": repr(learning_rate(rc, ((0 if rc.reset_optimizer else it) + 1) * rc.minibatches - 1)),
                "gen_tokens": gen_tokens,
                "buffered": len(pool),
            }
            if groups:
                row.update(_train_on(model, optimizer, rc, task, codec, groups, problems, version, ptx_ids))
                samples_done += len(groups) * rc.samples
                for g in groups:
                    problems.pop(g[0].group)
            engine.load_weights(model.state_dict(), version + 1)
            if rc.reset_optimizer:
                optimizer = _optimizer(model, rc)
            if (it + 1) % rc.eval_every == 0 or it + 1 == rc.iterations:
                row.update(_evaluate(engine, task, codec, rc))
            spent = time.perf_counter() - began
            elapsed += spent
            row.update(
                samples=samples_done, tokens_per_s=f"{gen_tokens / spent:.1f}", elapsed_s=f"{elapsed:.3f}"
            )
            writer.writerow(row)
            log_file.flush()
            if on_iteration is not None:
                on_iteration(row)
            if (it + 1) % rc.checkpoint_every == 0 or it + 1 == rc.iterations:
                extra = {
                    "samples": samples_done,
                    "elapsed_s": elapsed,
                    "pool": [t.to_json() for t in pool],
                    "problems": {str(k): asdict(v) for k, v in problems.items()},
                }
                save_training_state(run, it + 1, model, optimizer, extra, keep=2)
    return run


def _train_on(
    model, optimizer, rc: RLConfig, task: Task, codec: CharCodec, groups, problems, version, ptx_ids
) -> dict:
    """Grade, check consistency, update; the log row's figures."""
    trajs = [t for g in groups for t in g]
    texts = [task.reply(t.tokens, t.env, codec) for t in trajs]
    scores = torch.tensor(task.grade([problems[t.group] for t in trajs], texts), dtype=torch.float64)
    lengths = torch.tensor([len(t.tokens) for t in trajs])
    truncated = torch.tensor([t.finish_reason != "stop" for t in trajs])
    rewards = shape_rewards(scores, lengths, truncated, rc.samples, rc.length_coef, rc.truncation_penalty)
    check = check_consistency(model, trajs, rc.temperature, version)
    if rc.routing_replay:
        with torch.no_grad():
            old_logp = forward_logprobs(model, trajs, rc.temperature, replay=True)
    else:
        old_logp = check.trainer_logprobs
    first_step = (0 if rc.reset_optimizer else version) * rc.minibatches
    ptx = None
    if rc.ptx_coef:
        from k3.rl.ptx import ptx_batch, ptx_loss

        def ptx(n: int) -> torch.Tensor:
            step = version * rc.minibatches + n
            return rc.ptx_coef * ptx_loss(model, *ptx_batch(rc, task, codec, step, ptx_ids))

    loss, norm = update(
        model, optimizer, rc, groups, rewards, scores, version, old_logp.detach(), first_step, ptx
    )
    with torch.no_grad():
        packed = pack(trajs)
        new_logp = forward_logprobs(model, trajs, rc.temperature, rc.routing_replay, packed)
    mask = packed.mask
    kl = float((kl_estimate(old_logp, new_logp, "k3") * mask).sum() / mask.sum())
    return {
        "loss": repr(loss),
        "reward": f"{float(rewards.mean()):.6f}",
        "score": f"{float(scores.mean()):.6f}",
        "response_len": f"{float(lengths.double().mean()):.3f}",
        "truncated": f"{float(truncated.double().mean()):.4f}",
        "partial_share": f"{sum(t.partial for t in trajs) / len(trajs):.4f}",
        "kl": f"{kl:.6g}",
        "logprob_diff_mean": f"{check.logprob_diff_mean:.3g}",
        "logprob_diff_max": f"{check.logprob_diff_max:.3g}",
        "expert_flips": f"{check.expert_flips:.6f}",
        "grad_norm": f"{norm:.6g}",
    }
