"""`k3 rl` builds the task it is given with the run's options: `--digits` reaches arithmetic at an effort
(`arithmetic@long`) and inside a mixture, not only the plain task (it once fell back to 3 digits)."""

from __future__ import annotations

import re

from k3.rl.config import RLConfig
from k3.rl.trainer import task_of


def operand_lengths(prompts: list[str]) -> set[int]:
    """The lengths of the operands of every `a+b=` in the prompts (tags and other tasks ignored)."""
    return {len(x) for p in prompts for m in re.finditer(r"(\d+)\+(\d+)=", p) for x in m.groups()}


def test_digits_reach_arithmetic_at_an_effort():
    task = task_of(RLConfig(task="arithmetic@long", digits=2, held_out=50))
    prompts = [p.prompt for p in task.held_out(0)]
    assert all(p.startswith("<long>") for p in prompts)
    assert operand_lengths(prompts) == {2}
    assert task.max_tokens == (2 + 4) + (3 * 2 - 1) + 1  # the plain budget, the 2-column pad and `;`


def test_digits_reach_arithmetic_in_a_mixture_and_other_parts_ignore_them():
    task = task_of(RLConfig(task="arithmetic@short+sort", digits=4, held_out=60))
    prompts = [p.prompt for p in task.held_out(0)]
    assert operand_lengths(prompts) == {4}
    assert any(p.startswith("sort:") for p in prompts)  # sort built without --digits


def test_plain_tasks_unchanged():
    assert operand_lengths([p.prompt for p in task_of(RLConfig(digits=2, held_out=20)).held_out(0)]) == {2}
    assert task_of(RLConfig(task="sort", digits=2, held_out=20)).max_tokens == 5 + 4


def test_sft_command_passes_each_option_to_its_field(monkeypatch, tmp_path):
    """`k3 rl sft --threads 1` once set the held-out set to 1 problem (positional arguments out of step
    with SFTConfig), so its eval_acc column read 0 or 1."""
    from typer.testing import CliRunner

    import k3.rl.sft
    from k3.rl.commands import rl_app

    seen = []
    monkeypatch.setattr(k3.rl.sft, "sft", lambda sc, on_step=None: seen.append(sc) or tmp_path)
    args = ["sft", "--task", "arithmetic@long", "--out", str(tmp_path), "--steps", "7", "--batch-size", "5"]
    args += ["--lr", "0.25", "--digits", "2", "--seed", "3", "--eval-every", "4", "--threads", "1"]
    args += ["--held-out", "9", "--wrong-carry", "0.6"]
    result = CliRunner().invoke(rl_app, args)
    assert result.exit_code == 0, result.output
    sc = seen[0]
    assert (sc.task, sc.out, sc.steps, sc.batch_size, sc.lr) == ("arithmetic@long", str(tmp_path), 7, 5, 0.25)
    assert (sc.warmup, sc.digits, sc.seed, sc.eval_every, sc.threads) == (7, 2, 3, 4, 1)
    assert (sc.held_out, sc.wrong_carry) == (9, 0.6)
