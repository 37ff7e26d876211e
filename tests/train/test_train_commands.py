"""`k3 train`'s options are TrainConfig's fields: one option per field, with the field's default, and the
named choices validated by typer."""

from __future__ import annotations

from dataclasses import MISSING, fields
from enum import Enum

import typer
from typer.testing import CliRunner

from k3.train.commands import train_app
from k3.train.config import TrainConfig

COMMAND = typer.main.get_command(train_app)
OPTIONS = {p.name: p for p in COMMAND.params}


def test_every_field_has_an_option_with_the_fields_default():
    assert set(OPTIONS) == {f.name for f in fields(TrainConfig)}
    for f in fields(TrainConfig):
        assert f.default is not MISSING, f.name
        default = OPTIONS[f.name].default
        assert default == f.default and type(default) is type(f.default), f.name


def test_the_defaults_are_the_dataclass_values():
    """Planted: the values of TrainConfig (the CLI used to say 200 steps and 20 warm-up steps)."""
    planted = {"steps": 100, "warmup": 10, "out": "runs/tiny"}
    assert {name: OPTIONS[name].default for name in planted} == planted


def test_typer_refuses_what_is_not_one_of_the_choices():
    """Each named choice is validated before training starts: the message lists the enum's values."""
    choices = [f for f in fields(TrainConfig) if isinstance(f.default, Enum)]
    assert {f.name for f in choices} == {"optimizer", "schedule", "dtype", "balance"}
    for f in choices:
        option = "--" + f.name.replace("_", "-")
        result = CliRunner().invoke(train_app, [option, "bogus", "--quiet"], env={"COLUMNS": "300"})
        listed = ", ".join(f"'{m.value}'" for m in type(f.default))
        assert result.exit_code == 2 and f"'bogus' is not one of {listed}" in result.output, result.output


def test_quiet_is_the_negation_of_progress():
    flag = OPTIONS["progress"]
    assert flag.opts == ["--progress"] and flag.secondary_opts == ["--quiet"]
