"""The `k3 distill` loop: several teachers into one student, on-policy, with the baselines beside it.

Methods (`--method`):
- `on-policy` (the method): each iteration, `prompts` new problems of every domain, K student samples
  each through the engine (k3.rl.rollout); every sample scored by its domain's teacher
  (k3.distill.teachers.score); `minibatches` steps on the truncated importance-sampling loss with the
  reverse-KL advantages (or, with `full_vocab`, the exact full-vocabulary reverse KL, GKD beta = 1); the
  engine then loads the new weights.
- `off-policy`: the same prompts, but each domain's teacher writes the K samples (its own engine) and the
  student is fine-tuned on them (cross-entropy over the answer tokens); with `full_vocab`, the full-
  vocabulary `divergence` to the teacher's whole distribution at each of those teacher-sampled contexts
  (supervised KD), so that on- and off-policy can be compared at the same target.
- `--warm-start N`: iterations 0 .. N - 1 are off-policy ones, the same as an off-policy run's, at the peak
  rate `--warm-lr` (default `--lr`); then the method (the on-policy recipe's SFT'd start: the reverse KL's
  gradient vanishes on tokens the student rarely samples, so a student far from its teachers learns slowly
  from it); the schedule and optimizer go on. With `off-policy` it only marks where `--warm-lr` ends.
- `average`: no training; the student is the mean of the teachers' weights (shapes must match), evaluated.
- `rl`: the on-policy loop without teachers in the update: the advantage is the task's reward minus the
  mean over the prompt's K samples (RL on all the tasks at once, the baseline at equal samples); the
  teachers only measure `eval_rkl_<teacher>`.
A single generalist teacher is the same command with one teacher without a task (`--tasks` names the
domains it covers).

Teacher tokens (`teacher_tokens`, cumulative): answer tokens a teacher scored (on-policy) or wrote
(off-policy), so the two methods can be compared at equal teacher budgets.

A run folder is laid out as `k3 rl`'s (RUN/distill.json, RUN/log.csv, RUN/checkpoints/step-N,
RUN/config.json): `k3 rl export` and `k3 distill export` write its checkpoint; everything random is seeded by
(seed, iteration, group, sample, segment), so a run killed at any point and rerun gives the same log
(timing columns aside).
"""

from __future__ import annotations

import copy
import csv
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.distill.config import DistillConfig, DistillError
from k3.distill.losses import (
    advantages,
    distill_loss,
    full_vocab_kl,
    future_kl_advantages,
    gkd_loss,
    reward_advantages,
    sampled_reverse_kl,
)
from k3.distill.teachers import (
    assign_domains,
    average_weights,
    check_vocabularies,
    gather_tokens,
    load_teacher,
    log_distributions,
    parse_teacher,
    score,
    vocabulary_of,
)
from k3.rl.config import RESUMABLE_CHANGES
from k3.rl.evaluation import held_out_accuracy
from k3.rl.policy import pack, token_logprobs
from k3.rl.rollout import Trajectory, generate
from k3.tasks.codec import CharCodec
from k3.tasks.registry import make_task
from k3.tasks.task import Task
from k3.train.schedule import distillation_rate

DISTILL_JSON = "distill.json"
LOG_FILE = "log.csv"
TIMING = ("tokens_per_s", "elapsed_s")
EVAL_STREAM = -1  # group ids of the evaluation samples are negative (training groups count from 0)


def make_tasks(dc: DistillConfig, domains: list[str]) -> dict[str, Task]:
    def one(name: str) -> Task:
        options = {"digits": dc.digits} if name.startswith(("arithmetic", "calculator")) else {}
        return make_task(name, held_out_size=dc.held_out, **options)

    return {name: one(name) for name in domains}


def columns(domains: dict[str, str]) -> list[str]:
    teachers = list(dict.fromkeys(domains.values()))
    return [
        "step", "loss", "lr", "grad_norm", "samples", "student_tokens", "teacher_tokens",
        *[f"rkl_{t}" for t in teachers], *[f"score_{d}" for d in domains], *[f"acc_{d}" for d in domains],
        "acc_mean", *[f"eval_rkl_{t}" for t in teachers], *[f"sampled_acc_{d}" for d in domains],
        "logprob_diff_max", *TIMING,
    ]  # fmt: skip


@dataclass
class Setup:
    """What a run holds for its whole life: the student, teachers (loaded once) and domains."""

    model: torch.nn.Module
    teachers: dict[str, torch.nn.Module]
    domains: dict[str, str]  # task -> teacher name
    tasks: dict[str, Task]
    codec: CharCodec


def load_setup(dc: DistillConfig) -> Setup:
    from k3.rl.policy_io import load_policy

    specs = [parse_teacher(t) for t in dc.teachers]
    domains = assign_domains(specs, dc.tasks)
    model = load_policy(dc.student, dc.seed, option="--student").train()
    teachers = {s.name: load_teacher(s.source) for s in specs if s.name in domains.values()}
    vocab = model.config.vocab_size
    check_vocabularies(
        vocabulary_of(dc.student, vocab),
        {
            s.name: vocabulary_of(s.source, teachers[s.name].config.vocab_size)
            for s in specs
            if s.name in teachers
        },
    )
    return Setup(model, teachers, domains, make_tasks(dc, list(domains)), CharCodec(vocab))


def _optimizer(model, dc: DistillConfig):
    if dc.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=dc.lr)
    from k3.train.optim import build_optimizer

    return build_optimizer(model, "adamw", dc.lr, 0.0, (0.9, 0.95))


def learning_rate(dc: DistillConfig, step: int) -> float:
    """The learning rate of the optimizer's `step`-th update (0-based): k3.train.schedule.distillation_rate
    (a linear warm-up over `warmup` steps, then constant, or with `cosine` a half cosine to 0 at the run's
    last step) from the peak `warm_lr` during the `warm_start` iterations where given, else `lr`."""
    warm = dc.warm_lr is not None and step < dc.warm_start * dc.minibatches
    peak = dc.warm_lr if warm else dc.lr
    return distillation_rate(step, peak, dc.iterations * dc.minibatches, dc.warmup, dc.cosine)


def _batch(dc: DistillConfig, setup: Setup, it: int) -> tuple[list[Trajectory], list, list[str]]:
    """(trajectories, their problems, their domains): `prompts` per domain, K samples each."""
    trajs, problems, domain_of = [], [], []
    for d, (name, task) in enumerate(setup.tasks.items()):
        for p, problem in enumerate(task.problems(dc.seed, it, dc.prompts)):
            gid = (it * len(setup.tasks) + d) * dc.prompts + p
            for k in range(dc.samples):
                trajs.append(Trajectory(gid, k, task.prompt_ids(problem, setup.codec)))
                problems.append(problem)
                domain_of.append(name)
    return trajs, problems, domain_of


def _generate(engines: dict[str, object], setup: Setup, trajs, domain_of, dc: DistillConfig) -> int:
    """Each domain's trajectories by its engine (engines: domain -> Engine), to the task's budget."""
    tokens = 0
    for name, task in setup.tasks.items():
        mine = [t for t, d in zip(trajs, domain_of, strict=True) if d == name]
        tokens += generate(
            engines[name], mine, seed=dc.seed, temperature=dc.temperature, stop_id=task.stop_id(setup.codec),
            max_tokens=task.max_tokens, tool=task.tool(setup.codec),
        )  # fmt: skip
    return tokens


def _evaluate(engine, setup: Setup, dc: DistillConfig) -> dict:
    """Greedy held-out accuracy per task, and on the student's own samples (at the run's temperature) of
    `eval_samples` held-out prompts per domain (the same prompts and seeds at every eval) the sampled
    reverse KL to each teacher and the share graded right (`sampled_acc_<task>`)."""
    row, accs = {}, []
    for name, task in setup.tasks.items():
        acc = held_out_accuracy(engine, task, setup.codec, dc.seed)
        row[f"acc_{name}"] = f"{acc:.6f}"
        accs.append(acc)
    row["acc_mean"] = f"{sum(accs) / len(accs):.6f}"
    trajs, domain_of, problems = [], [], []
    for d, (name, task) in enumerate(setup.tasks.items()):
        for i, problem in enumerate(task.held_out(dc.seed)[: dc.eval_samples]):
            trajs.append(Trajectory(EVAL_STREAM - d * 10**6 - i, 0, task.prompt_ids(problem, setup.codec)))
            domain_of.append(name)
            problems.append(problem)
    _generate(dict.fromkeys(setup.tasks, engine), setup, trajs, domain_of, dc)
    for name, task in setup.tasks.items():
        rows = [i for i, d in enumerate(domain_of) if d == name]
        texts = [task.reply(trajs[i].tokens, trajs[i].env, setup.codec) for i in rows]
        right = task.grade([problems[i] for i in rows], texts)
        row[f"sampled_acc_{name}"] = f"{sum(right) / len(rows):.6f}"
    teacher_of = [setup.domains[d] for d in domain_of]
    scores = score(setup.model, setup.teachers, teacher_of, trajs, dc.temperature)
    for teacher, kl in sampled_reverse_kl(scores, teacher_of).items():
        row[f"eval_rkl_{teacher}"] = f"{kl:.6f}"
    return row


def _step(model, optimizer, dc: DistillConfig, loss: torch.Tensor, step: int) -> float:
    """One update, the optimizer's `step`-th (0-based; its learning rate from the warm-up)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(dc, step)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), dc.grad_clip or math.inf))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _on_policy(setup: Setup, optimizer, dc: DistillConfig, it: int, trajs, problems, domain_of) -> dict:
    """Score, then `minibatches` updates (rows m, m + M, ... so each mixes the domains; the optimizer's
    (it x minibatches)-th update first); the log figures."""
    model, codec = setup.model, setup.codec
    teacher_of = [setup.domains[d] for d in domain_of]
    rewards = torch.zeros(len(trajs))
    for name, task in setup.tasks.items():
        rows = [i for i, d in enumerate(domain_of) if d == name]
        texts = [task.reply(trajs[i].tokens, trajs[i].env, codec) for i in rows]
        rewards[rows] = torch.tensor(task.grade([problems[i] for i in rows], texts))
    behaviour = torch.zeros(len(trajs), max(len(t.tokens) for t in trajs))  # [N, T] as score's rows
    generated = torch.zeros_like(behaviour)
    for b, t in enumerate(trajs):
        behaviour[b, : len(t.logprobs)] = torch.tensor(t.logprobs)
        generated[b, : len(t.logprobs)] = 1.0
    row, outcome = {}, reward_advantages(rewards, generated, dc.samples)  # [N, T] reward - its group's mean
    if dc.method == "rl":  # the baseline: no teacher, the task reward the only advantage
        adv = outcome
    else:
        scores = score(model, setup.teachers, teacher_of, trajs, dc.temperature, full_vocab=dc.full_vocab)
        # the sampled-token advantage: MOPD's outcome term, plus the KL's unless the full-vocabulary
        # losses below give its gradient
        adv = dc.alpha_reward * outcome
        if not dc.full_vocab:
            adv = advantages(scores, dc.kl_discount, dc.kl_length_norm) + adv
        row["logprob_diff_max"] = f"{float(((scores.student - behaviour).abs() * scores.mask).max()):.3g}"
        for teacher, kl in sampled_reverse_kl(scores, teacher_of).items():
            row[f"rkl_{teacher}"] = f"{kl:.6f}"
    losses, norm = [], 0.0
    for m in range(dc.minibatches):
        rows = list(range(m, len(trajs), dc.minibatches))
        packed = pack([trajs[i] for i in rows])
        n = packed.mask.shape[1]
        if dc.full_vocab:
            student_dist = log_distributions(model, packed, dc.temperature)
            kl = full_vocab_kl(student_dist, scores.teacher_dist[rows, :n], dc.divergence)  # [n, T]
            loss = gkd_loss(kl, packed.mask)
            if dc.kl_discount or dc.alpha_reward:  # a policy gradient on the sampled tokens beside it
                pg = adv[rows, :n]  # MOPD's outcome term
                if dc.kl_discount:  # the sequence-level reverse KL: the contexts after each token too
                    pg = future_kl_advantages(kl, packed.mask, dc.kl_discount, dc.kl_baseline,
                                              dc.kl_length_norm) + pg  # fmt: skip
                logp = gather_tokens(student_dist, packed)
                loss = loss + distill_loss(logp, behaviour[rows, :n], pg, packed.mask, dc.is_low, dc.is_high)
        else:
            logp = token_logprobs(model, packed, dc.temperature)
            loss = distill_loss(logp, behaviour[rows, :n], adv[rows, :n], packed.mask, dc.is_low, dc.is_high)
        norm = _step(model, optimizer, dc, loss, it * dc.minibatches + m)
        losses.append(float(loss.detach()))
    row.update(loss=repr(sum(losses) / len(losses)), grad_norm=f"{norm:.6g}")
    for name in setup.tasks:
        rows = [i for i, d in enumerate(domain_of) if d == name]
        row[f"score_{name}"] = f"{float(rewards[rows].mean()):.6f}"
    return row


def _off_policy(
    setup: Setup, optimizer, dc: DistillConfig, it: int, trajs, problems, domain_of, kd: bool = False
) -> dict:
    """Fine-tune on the teachers' samples: cross-entropy over their answer tokens (`minibatches` updates);
    with `kd` (`--method off-policy --full-vocab`) the full-vocabulary divergence to the teacher's whole
    distribution at each of its own sampled contexts instead (supervised KD: the contexts off-policy, the
    target as dense as GKD's)."""
    model, codec = setup.model, setup.codec
    if kd:
        teacher_of = [setup.domains[d] for d in domain_of]
        teacher_dist = score(model, setup.teachers, teacher_of, trajs, dc.temperature, True).teacher_dist
    losses, norm = [], 0.0
    for m in range(dc.minibatches):
        rows = list(range(m, len(trajs), dc.minibatches))
        packed = pack([trajs[i] for i in rows])
        if kd:
            n = packed.mask.shape[1]
            student_dist = log_distributions(model, packed, dc.temperature)
            loss = gkd_loss(full_vocab_kl(student_dist, teacher_dist[rows, :n], dc.divergence), packed.mask)
        else:
            logp = token_logprobs(model, packed, 1.0)
            loss = -(logp * packed.mask).sum() / packed.mask.sum().clamp(min=1)
        norm = _step(model, optimizer, dc, loss, it * dc.minibatches + m)
        losses.append(float(loss.detach()))
    row = {"loss": repr(sum(losses) / len(losses)), "grad_norm": f"{norm:.6g}"}
    for name, task in setup.tasks.items():
        rows = [i for i, d in enumerate(domain_of) if d == name]
        texts = [task.reply(trajs[i].tokens, trajs[i].env, codec) for i in rows]
        right = task.grade([problems[i] for i in rows], texts)
        row[f"score_{name}"] = f"{sum(right) / len(right):.6f}"  # the teacher's samples
    return row


def train_distill(dc: DistillConfig, on_iteration: Callable[[dict], None] | None = None) -> Path:
    """Run (or resume) the distillation run `dc` describes; returns the run folder."""
    from k3.engine.generate import Engine
    from k3.train.state import (
        cut_log,
        list_checkpoints,
        load_training_state,
        save_training_state,
        write_run_config,
    )

    dc.check()
    run = Path(dc.out)
    write_run_config(dc, run / DISTILL_JSON, RESUMABLE_CHANGES, DistillError)
    if dc.threads:
        torch.set_num_threads(dc.threads)
    setup = load_setup(dc)
    model = setup.model
    if dc.method == "average":
        plain = [copy.deepcopy(t).dequantize_experts(torch.float32) for t in setup.teachers.values()]
        model.load_state_dict(average_weights(plain), strict=True)
    model.config.save(run / "config.json")
    optimizer = _optimizer(model, dc)
    start, counters, elapsed = 0, {"samples": 0, "student_tokens": 0, "teacher_tokens": 0}, 0.0
    checkpoints = list_checkpoints(run)
    if checkpoints:
        meta = load_training_state(checkpoints[-1][1], model, optimizer)
        start, counters, elapsed = meta["step"], meta["counters"], meta["elapsed_s"]
    engine = Engine(copy.deepcopy(model).eval(), max_batch=dc.max_batch)
    engine.policy_version = start
    teacher_engines = {}
    if dc.method == "off-policy" or dc.warm_start:
        engines = {t: Engine(m, max_batch=dc.max_batch) for t, m in setup.teachers.items()}
        teacher_engines = {d: engines[t] for d, t in setup.domains.items()}
    cols = columns(setup.domains)
    log_path = run / LOG_FILE
    cut_log(log_path, cols, start)
    iterations = 0 if dc.method == "average" else dc.iterations
    last = iterations if dc.stop_after is None else min(iterations, dc.stop_after)
    with log_path.open("a", newline="") as log_file:
        writer = csv.DictWriter(log_file, fieldnames=cols)
        if start == 0:
            writer.writerow({"step": 0, **counters, **_evaluate(engine, setup, dc)})
            log_file.flush()
            if dc.method == "average":
                save_training_state(run, 0, model, optimizer, {"counters": counters, "elapsed_s": 0.0})
        for it in range(start, last):
            began = time.perf_counter()
            trajs, problems, domain_of = _batch(dc, setup, it)
            if dc.method in ("on-policy", "rl") and it >= dc.warm_start:
                tokens = _generate(dict.fromkeys(setup.tasks, engine), setup, trajs, domain_of, dc)
                row = _on_policy(setup, optimizer, dc, it, trajs, problems, domain_of)
                counters["student_tokens"] += tokens
                counters["teacher_tokens"] += tokens if dc.method == "on-policy" else 0
            else:
                tokens = _generate(teacher_engines, setup, trajs, domain_of, dc)
                kd = dc.full_vocab and dc.method == "off-policy"  # a warm start is always SFT
                row = _off_policy(setup, optimizer, dc, it, trajs, problems, domain_of, kd)
                counters["teacher_tokens"] += tokens
            counters["samples"] += len(trajs)
            engine.load_weights(model.state_dict(), it + 1)
            if (it + 1) % dc.eval_every == 0 or it + 1 == dc.iterations:
                row.update(_evaluate(engine, setup, dc))
            spent = time.perf_counter() - began
            elapsed += spent
            row.update(step=it + 1, lr=repr(learning_rate(dc, (it + 1) * dc.minibatches - 1)), **counters)
            row.update(tokens_per_s=f"{tokens / spent:.1f}", elapsed_s=f"{elapsed:.3f}")
            writer.writerow(row)
            log_file.flush()
            if on_iteration is not None:
                on_iteration(row)
            if (it + 1) % dc.checkpoint_every == 0 or it + 1 == dc.iterations:
                save_training_state(
                    run, it + 1, model, optimizer, {"counters": counters, "elapsed_s": elapsed}
                )
    return run
