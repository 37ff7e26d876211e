"""`k3 distill` end to end on tiny: a teacher equal to the student leaves the weights bitwise unchanged
(SGD, large lr), a SIGKILLed run resumes to identical logs, export and plot; off-policy counts the teacher
tokens it generated; a generalist teacher covers every domain; averaged weights are the teachers' mean;
a teacher with another vocabulary is refused by name."""

import csv
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3.config import K3Config
from k3.distill.config import DistillError
from k3.distill.loop import TIMING, DistillConfig, learning_rate, train_distill
from k3.errors import K3Error
from k3.model import K3ForCausalLM
from k3.rl.policy_io import POLICY_FILE, save_policy
from k3.train.state import list_checkpoints

SMALL = dict(prompts=1, samples=2, held_out=4, eval_samples=2, eval_every=2, digits=1, threads=1)


@pytest.fixture(scope="module")
def policies(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("policies")
    cfg = K3Config.from_pretrained("tiny")
    return {
        s: save_policy(K3ForCausalLM.from_config(cfg, seed=s, quantized_experts=False), root / f"p{s}")
        for s in (0, 1)
    }


def _rows(run: Path) -> list[dict]:
    with (run / "log.csv").open(newline="") as f:
        return [{k: v for k, v in row.items() if k not in TIMING} for row in csv.DictReader(f)]


def _weights(run: Path) -> dict:
    return load_file(str(list_checkpoints(run)[-1][1] / "model.safetensors"))


@pytest.mark.parametrize("extra", [{}, dict(kl_discount=1.0), dict(kl_discount=1.0, kl_length_norm=True)])
def test_teacher_equal_to_student_leaves_weights_bitwise_unchanged(tmp_path, policies, extra):
    p0 = str(policies[0])
    dc = DistillConfig(
        student=p0,
        teachers=[f"a={p0}:arithmetic", f"s={p0}:sort"],
        out=str(tmp_path / "run"),
        iterations=2,
        optimizer="sgd",
        lr=100.0,
        **extra,
        **SMALL,
    )
    train_distill(dc)
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    for r in rows[1:]:
        assert float(r["rkl_a"]) == 0.0 and float(r["rkl_s"]) == 0.0 and float(r["grad_norm"]) == 0.0
    start = load_file(str(policies[0] / POLICY_FILE))
    end = _weights(tmp_path / "run")
    assert all(torch.equal(start[k], end[k]) for k in start)


def _cli(run: Path, policies, *extra: str) -> list[str]:
    args = [
        "--student",
        str(policies[0]),
        "--teacher",
        f"a={policies[1]}:arithmetic",
        "--teacher",
        f"s={policies[1]}:sort",
        "--out",
        str(run),
        "--iterations",
        "3",
        "--prompts",
        "1",
        "--samples",
        "2",
        "--held-out",
        "4",
        "--eval-samples",
        "2",
        "--eval-every",
        "2",
        "--digits",
        "1",
        "--threads",
        "1",
        "--lr",
        "0.01",
        "--quiet",
    ]
    return [sys.executable, "-m", "k3", "distill", *args, *extra]


def test_sigkill_resume_gives_identical_logs_export_and_plot(tmp_path, policies):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(_cli(whole, policies), check=True, timeout=900)
    proc = subprocess.Popen(_cli(killed, policies))
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if list_checkpoints(killed) and len(_rows(killed)) >= 2:  # step 0 and 1 written
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(_rows(killed)) < 4, "the run finished before it was killed"
    subprocess.run(_cli(killed, policies), check=True, timeout=900)
    assert _rows(killed) == _rows(whole)
    rows = _rows(whole)
    assert all(r["rkl_a"] and r["rkl_s"] for r in rows[1:]) and rows[-1]["acc_arithmetic"]
    a, b = _weights(whole), _weights(killed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    out = tmp_path / "export"
    subprocess.run(
        [sys.executable, "-m", "k3", "distill", "export", str(whole), str(out)], check=True, timeout=300
    )
    assert K3ForCausalLM.from_pretrained(out).config.vocab_size == 1024
    subprocess.run([sys.executable, "-m", "k3", "distill", "plot", str(whole)], check=True, timeout=300)
    assert (whole / "distill.png").stat().st_size > 1000
    # the exported (MXFP4) student is a teacher too: the vocabulary check accepts its tokenizer files
    dc = DistillConfig(
        student=str(policies[0]),
        teachers=[f"e={out}:arithmetic"],
        out=str(tmp_path / "again"),
        iterations=1,
        **SMALL,
    )
    train_distill(dc)
    assert _rows(tmp_path / "again")[1]["rkl_e"]


def test_a_calculator_domain_is_distilled_in_the_chat_format(tmp_path, policies, monkeypatch):
    """The calculator domain's samples are the task's chat-format rollouts (its prompts, its stop id
    `<|end_of_msg|>`, its tool), and a teacher equal to the student scores them with reverse KL 0."""
    import k3.distill.loop
    from k3.tasks.codec import CharCodec
    from k3.tasks.registry import make_task

    calls = []
    real = k3.distill.loop.generate

    def spy(engine, trajs, **kw):
        calls.append(([list(t.prompt) for t in trajs], kw["stop_id"], kw["tool"]))
        return real(engine, trajs, **kw)

    monkeypatch.setattr(k3.distill.loop, "generate", spy)
    p0 = str(policies[0])
    dc = DistillConfig(student=p0, teachers=[f"c={p0}:calculator"], out=str(tmp_path / "run"), iterations=1,
                       **{**SMALL, "held_out": 1, "eval_samples": 1})  # fmt: skip
    train_distill(dc)
    row = _rows(tmp_path / "run")[1]
    assert float(row["rkl_c"]) == 0.0 and row["acc_calculator"]
    task, codec = make_task("calculator", digits=1, held_out_size=1), CharCodec(1024)
    want = {tuple(task.prompt_ids(p, codec)) for i in range(2) for p in task.problems(dc.seed, i, 1)}
    want |= {tuple(task.prompt_ids(p, codec)) for p in task.held_out(dc.seed)}
    assert calls and all(
        stop == codec.tokenizer.special.end_of_msg and tool is not None for _, stop, tool in calls
    )
    assert {tuple(p) for prompts, _, _ in calls for p in prompts} <= want


def test_off_policy_generalist_counts_teacher_tokens(tmp_path, policies):
    dc = DistillConfig(
        student=str(policies[0]),
        teachers=[f"g={policies[1]}"],
        tasks=["arithmetic", "sort"],
        method="off-policy",
        out=str(tmp_path / "off"),
        iterations=1,
        **SMALL,
    )
    train_distill(dc)
    row = _rows(tmp_path / "off")[1]
    assert row["rkl_g"] == "" and row["eval_rkl_g"] and row["acc_sort"] and row["acc_arithmetic"]
    # each of the 4 teacher samples wrote between 1 token and its task's budget (arithmetic 5, sort 9)
    assert 4 <= int(row["teacher_tokens"]) <= 2 * 5 + 2 * 9
    assert int(row["student_tokens"]) == 0 and int(row["samples"]) == 4  # 2 domains x 1 prompt x 2 samples


def test_average_is_the_teachers_mean(tmp_path, policies):
    dc = DistillConfig(
        student="tiny",
        teachers=[f"a={policies[0]}:arithmetic", f"b={policies[1]}:sort"],
        method="average",
        out=str(tmp_path / "avg"),
        **SMALL,
    )
    train_distill(dc)
    w0, w1 = (load_file(str(policies[s] / POLICY_FILE)) for s in (0, 1))
    avg = _weights(tmp_path / "avg")
    k = "lm_head.weight"
    assert torch.allclose(avg[k], (w0[k] + w1[k]) / 2, atol=1e-7) and not torch.equal(avg[k], w0[k])
    assert [r["step"] for r in _rows(tmp_path / "avg")] == ["0"]


def test_teacher_with_another_vocabulary_is_refused(tmp_path, policies):
    cfg = dataclasses.replace(K3Config.from_pretrained("tiny"), vocab_size=2048)
    other = save_policy(K3ForCausalLM.from_config(cfg, quantized_experts=False), tmp_path / "big")
    dc = DistillConfig(
        student=str(policies[0]),
        teachers=[f"ok={policies[1]}:sort", f"big={other}:arithmetic"],
        out=str(tmp_path / "run"),
        **SMALL,
    )
    with pytest.raises(DistillError, match=r"teacher big: vocab_size 2048 \(student: 1024\)"):
        train_distill(dc)


def test_full_vocabulary_run_and_bad_options(tmp_path, policies):
    dc = DistillConfig(
        student=str(policies[0]),
        teachers=[f"a={policies[1]}:arithmetic"],
        full_vocab=True,
        out=str(tmp_path / "gkd"),
        iterations=1,
        **SMALL,
    )
    train_distill(dc)
    row = _rows(tmp_path / "gkd")[1]
    assert float(row["loss"]) > 0 and float(row["grad_norm"]) > 0  # an exact KL of two different models
    with pytest.raises(DistillError, match="--method"):
        DistillConfig(teachers=["a=x"], method="ppo").check()
    with pytest.raises(DistillError, match="--full-vocab"):
        DistillConfig(teachers=["a=x"], method="rl", full_vocab=True).check()
    with pytest.raises(DistillError, match="--is-low"):
        DistillConfig(teachers=["a=x"], is_low=1.5).check()
    with pytest.raises(DistillError, match="--teacher"):
        DistillConfig().check()


def test_rl_method_takes_no_teacher_signal(tmp_path, policies):
    """`--method rl`: the reward is the only advantage. An untrained student is never right, so every
    group-centred reward is 0 and SGD at lr 100 leaves it bitwise unchanged although its teacher differs
    (on-policy distillation from that teacher moves it); no teacher tokens are spent."""
    common = dict(student=str(policies[0]), teachers=[f"a={policies[1]}:arithmetic"], iterations=1)
    common.update(optimizer="sgd", lr=100.0, **SMALL)
    train_distill(DistillConfig(method="rl", out=str(tmp_path / "rl"), **common))
    rows = _rows(tmp_path / "rl")
    assert float(rows[1]["score_arithmetic"]) == 0.0 and float(rows[1]["grad_norm"]) == 0.0
    assert rows[1]["teacher_tokens"] == "0" and int(rows[1]["student_tokens"]) > 0
    # the teacher still measures the held-out reverse KL (a sampled estimate: either sign, not 0 here)
    assert rows[1]["rkl_a"] == "" and math.isfinite(float(rows[1]["eval_rkl_a"]))
    assert float(rows[1]["eval_rkl_a"]) != 0.0
    start = load_file(str(policies[0] / POLICY_FILE))
    assert all(torch.equal(start[k], v) for k, v in _weights(tmp_path / "rl").items())
    train_distill(DistillConfig(method="on-policy", out=str(tmp_path / "on"), **common))
    assert any(not torch.equal(start[k], v) for k, v in _weights(tmp_path / "on").items())


def test_learning_rate_warms_up_linearly(tmp_path, policies, monkeypatch):
    """The schedule against planted values, and the rates the optimizer actually stepped with (recorded
    at each SGD step) in a run of 2 iterations x 2 minibatches with a 3-step warm-up; the logged `lr` is
    each iteration's last; `--warmup` reaches the config from the command line."""
    assert [learning_rate(DistillConfig(lr=1.0, warmup=4), s) for s in range(6)] == [0.25, 0.5, 0.75, 1, 1, 1]
    assert learning_rate(DistillConfig(lr=0.3, warmup=0), 0) == 0.3
    # warm_lr: the peak of the warm-start iterations' steps (1 iteration x 2 minibatches), then lr
    dc = DistillConfig(lr=0.1, warm_lr=1.0, warmup=2, warm_start=1, minibatches=2, iterations=3)
    assert [learning_rate(dc, s) for s in range(5)] == [0.5, 1.0, 0.1, 0.1, 0.1]
    # cosine: 2 warm-up steps, then 0.5 (1 + cos(pi k / 4)) for k = 1..4 over the 3 x 2 - 2 remaining steps
    dc = DistillConfig(lr=1.0, warmup=2, cosine=True, iterations=3, minibatches=2)
    got = [learning_rate(dc, s) for s in range(6)]
    assert got == pytest.approx([0.5, 1.0, 0.853553390593, 0.5, 0.146446609407, 0.0], abs=1e-12)
    used = []
    step = torch.optim.SGD.step

    def recording(self, *args, **kwargs):
        used.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", recording)
    dc = DistillConfig(
        student=str(policies[0]), teachers=[f"a={policies[1]}:arithmetic"], out=str(tmp_path / "run"),
        iterations=2, optimizer="sgd", lr=0.03, warmup=3, minibatches=2, **SMALL,
    )  # fmt: skip
    train_distill(dc)
    assert used == pytest.approx([0.01, 0.02, 0.03, 0.03], rel=1e-12)
    assert [float(r["lr"]) for r in _rows(tmp_path / "run")[1:]] == pytest.approx([0.02, 0.03], rel=1e-12)
    out = subprocess.run(
        _cli(tmp_path / "bad", policies, "--warmup", "-1"), capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "--warmup: must be >= 0" in out.stdout + out.stderr


def test_warm_start_is_the_off_policy_run_then_on_policy(tmp_path, policies):
    """`warm_start=1`: iteration 1 of an on-policy run is an off-policy run's first iteration (same log row
    apart from timing, same weights bit for bit); iteration 2 is on-policy (the teacher scores the
    student's samples: reverse KL logged, student tokens counted as teacher tokens)."""
    common = dict(student=str(policies[0]), teachers=[f"a={policies[1]}:arithmetic"], iterations=2, **SMALL)
    off = train_distill(DistillConfig(method="off-policy", out=str(tmp_path / "off"), **common))
    warm = train_distill(DistillConfig(full_vocab=True, warm_start=1, out=str(tmp_path / "warm"), **common))
    r_off, r_warm = _rows(off), _rows(warm)
    assert r_warm[:2] == r_off[:2] and r_warm[1]["rkl_a"] == "" and int(r_warm[1]["student_tokens"]) == 0
    step1 = [dict(list_checkpoints(run))[1] / "model.safetensors" for run in (off, warm)]
    w_off, w_warm = (load_file(str(p)) for p in step1)
    assert all(torch.equal(w_off[k], w_warm[k]) for k in w_off)
    assert r_off[2]["rkl_a"] == "" and math.isfinite(float(r_warm[2]["rkl_a"]))
    spent = int(r_warm[2]["student_tokens"])
    assert spent > 0 and int(r_warm[2]["teacher_tokens"]) == int(r_warm[1]["teacher_tokens"]) + spent
    with pytest.raises(DistillError, match="--warm-start"):
        DistillConfig(teachers=["a=x"], iterations=3, warm_start=4).check()
    with pytest.raises(DistillError, match="--warm-start"):
        DistillConfig(teachers=["a=x"], method="average", warm_start=1).check()


def test_off_policy_full_vocab_is_kd_on_the_teachers_samples(tmp_path, policies):
    """`--method off-policy --full-vocab`: the logged loss of iteration 1 is the forward KL(teacher ||
    student) at every context of the teacher's own samples, recomputed here one prefix at a time (no
    packing); the same samples (teacher tokens) as the SFT run, whose loss (cross-entropy) differs."""
    from k3.distill.loop import _batch, _generate, load_setup
    from k3.engine.generate import Engine

    common = dict(
        student=str(policies[0]), teachers=[f"a={policies[1]}:arithmetic"], method="off-policy",
        iterations=1, minibatches=1, optimizer="sgd", lr=0.0, **SMALL,
    )  # fmt: skip
    kd = DistillConfig(full_vocab=True, divergence="forward", out=str(tmp_path / "kd"), **common)
    sft = DistillConfig(out=str(tmp_path / "sft"), **common)
    r_kd, r_sft = _rows(train_distill(kd))[1], _rows(train_distill(sft))[1]
    setup = load_setup(kd)
    trajs, _, domain_of = _batch(kd, setup, 0)
    teacher = setup.teachers["a"]
    _generate({"arithmetic": Engine(teacher, max_batch=kd.max_batch)}, setup, trajs, domain_of, kd)
    kls = []
    with torch.no_grad():
        for t in trajs:
            seq = t.prompt + t.tokens
            for i in range(len(t.tokens)):
                ctx = torch.tensor([seq[: len(t.prompt) + i]])
                p = torch.log_softmax(teacher(ctx)[0, -1].double(), -1)
                q = torch.log_softmax(setup.model(ctx)[0, -1].double(), -1)
                kls.append(float((p.exp() * (p - q)).sum()))
    assert int(r_kd["teacher_tokens"]) == int(r_sft["teacher_tokens"]) == len(kls) > 0
    assert float(r_kd["loss"]) == pytest.approx(sum(kls) / len(kls), rel=1e-4)
    assert abs(float(r_sft["loss"]) - float(r_kd["loss"])) > 1e-3


def _ascii_student(tmp_path: Path, monkeypatch) -> tuple[K3ForCausalLM, Path]:
    """A tiny student whose output layer favours the byte ids (so its texts are varied ASCII), saved as a
    policy, and arithmetic graded by a planted rule: right is a text with a digit."""
    from k3.tasks.exact_match import Arithmetic

    student = K3ForCausalLM.from_config(K3Config.from_pretrained("tiny"), seed=0, quantized_experts=False)
    with torch.no_grad():
        student.lm_head.weight[128:] = 0.0
        student.lm_head.weight[:128] *= 30.0
    monkeypatch.setattr(
        Arithmetic, "grade", lambda self, ps, rs: [float(any(c.isdigit() for c in r)) for r in rs]
    )
    return student, save_policy(student, tmp_path / "ascii")


def test_sampled_accuracy_grades_the_students_own_held_out_samples(tmp_path, monkeypatch):
    """`sampled_acc_<task>` at row 0: the student's samples of the first `eval_samples` held-out prompts,
    drawn again here through the engine with the rollout's seeds, graded by a planted rule (right: a text
    with a digit). The student's output layer favours the byte ids, so its texts are varied ASCII."""
    from k3.distill.loop import EVAL_STREAM, make_tasks
    from k3.engine.generate import Engine
    from k3.engine.sampling import SamplingParams
    from k3.rl.rollout import trajectory_seed
    from k3.tasks.codec import CharCodec

    student, policy = _ascii_student(tmp_path, monkeypatch)
    dc = DistillConfig(
        student=str(policy), teachers=[f"a={policy}:arithmetic"], out=str(tmp_path / "run"),
        iterations=1, **{**SMALL, "eval_samples": 6, "held_out": 8},
    )  # fmt: skip
    row0 = _rows(train_distill(dc))[0]
    task, codec = make_tasks(dc, ["arithmetic"])["arithmetic"], CharCodec(1024)
    prompts = [codec.encode(p.prompt) for p in task.held_out(dc.seed)[:6]]
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=task.max_tokens,
            stop_ids=frozenset({codec.eos}),
            seed=trajectory_seed(dc.seed, EVAL_STREAM - i, 0),
            seed_position=0,
        )  # fmt: skip
        for i in range(6)
    ]
    texts = [codec.decode(c.tokens) for c in Engine(student.eval()).complete(prompts, params)]
    right = sum(any(c.isdigit() for c in t) for t in texts)
    assert 0 < right < 6, texts  # the planted rule tells these samples apart
    assert float(row0["sampled_acc_arithmetic"]) == pytest.approx(right / 6)


def test_alpha_reward_trains_with_either_kl_loss(tmp_path, monkeypatch):
    """`--alpha-reward`, with the sampled-token loss and with `--full-vocab`: with the student as its own
    teacher the KL has no gradient, so one SGD iteration is exactly `--method rl`'s (the same samples, the
    same group-centred reward as the only signal), and without the reward term the weights stay put. The
    student's texts are varied ASCII, graded by a planted rule (right: a text with a digit), so the groups'
    rewards differ."""
    _, policy = _ascii_student(tmp_path, monkeypatch)
    common = dict(
        student=str(policy), teachers=[f"a={policy}:arithmetic"], iterations=1, optimizer="sgd", lr=1.0,
        warmup=0, **{**SMALL, "prompts": 4, "samples": 4},
    )  # fmt: skip
    runs = {
        name: DistillConfig(out=str(tmp_path / name), **common, **extra)
        for name, extra in (
            ("rl", dict(method="rl")),
            ("sampled", dict(alpha_reward=1.0)),
            ("sampled0", {}),
            ("full", dict(full_vocab=True, alpha_reward=1.0)),
            ("full0", dict(full_vocab=True)),
        )
    }
    for dc in runs.values():
        train_distill(dc)
    start = load_file(str(policy / POLICY_FILE))
    rl, sampled, sampled0, full, full0 = (_weights(tmp_path / name) for name in runs)
    assert 0.0 < float(_rows(tmp_path / "rl")[1]["score_arithmetic"]) < 1.0  # mixed rewards: a signal
    moved = max(float((rl[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-3
    for trained, still in ((sampled, sampled0), (full, full0)):
        assert all(torch.allclose(trained[k], rl[k], atol=moved * 1e-4, rtol=0) for k in start)
        assert all(torch.allclose(still[k], start[k], atol=moved * 1e-4, rtol=0) for k in start)


def test_kl_discount_changes_the_advantage_the_run_trains_on(tmp_path, policies):
    """Same start, prompts and samples: the first iteration's loss (lr 0, so the samples agree) differs
    with the discounted advantage, and its reverse KL (measured before the update) does not."""
    common = dict(
        student=str(policies[0]), teachers=[f"a={policies[1]}:arithmetic"], iterations=1, optimizer="sgd",
        lr=0.0, **SMALL,
    )  # fmt: skip
    plain = _rows(train_distill(DistillConfig(out=str(tmp_path / "g0"), **common)))[1]
    summed = _rows(train_distill(DistillConfig(out=str(tmp_path / "g1"), kl_discount=1.0, **common)))[1]
    assert plain["rkl_a"] == summed["rkl_a"] and plain["student_tokens"] == summed["student_tokens"]
    assert abs(float(plain["loss"]) - float(summed["loss"])) > 1e-4
    full = dict(common, full_vocab=True, samples=4)  # the full-vocabulary sequence-level term, centred or not
    losses = [
        _rows(train_distill(DistillConfig(out=str(tmp_path / name), **full, **extra)))[1]["loss"]
        for name, extra in (
            ("f0", {}),
            ("f1", dict(kl_discount=1.0)),
            ("f1b", dict(kl_discount=1.0, kl_baseline=True)),
            ("f1bn", dict(kl_discount=1.0, kl_baseline=True, kl_length_norm=True)),
        )
    ]
    assert len({float(v) for v in losses}) == 4


@pytest.mark.parametrize(
    "option, name, teacher",
    [("--student", "minii", "a=tiny:arithmetic"), ("--teacher", "tinyy", "a=tinyy:arithmetic")],
)
def test_a_model_that_is_not_there_is_blamed_on_its_own_option(tmp_path, option, name, teacher):
    """The error names the option that gave the bad source (it named `--init`, `k3 rl`'s, before)."""
    student = "minii" if option == "--student" else "tiny"
    dc = DistillConfig(student=student, teachers=[teacher], out=str(tmp_path / "run"), **SMALL)
    with pytest.raises(K3Error) as caught:
        train_distill(dc)
    assert str(caught.value).startswith(f"{option} {name}: not a preset, checkpoint or policy folder")
