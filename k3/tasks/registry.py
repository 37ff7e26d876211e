"""Every task by name: `make_task("sort@long", digits=2)`, `make_task("arithmetic+sort")` (k3.tasks.task lists
the names)."""

from __future__ import annotations

from dataclasses import fields

from k3.tasks.code_task import CodeTask
from k3.tasks.effort import with_effort
from k3.tasks.exact_match import Arithmetic, EitherWayArithmetic, Recall, Sort
from k3.tasks.mixture import Mixture
from k3.tasks.task import TASK_NAMES, Task, TaskError
from k3.tasks.tool_task import Calculator


def make_task(name: str, **options) -> Task:
    """The task called `name` (see TASK_NAMES), built with its options; `name@effort` (`sort@long`) is that
    task with a scratchpad of that effort, chosen by a tag in the prompt (k3.tasks.effort); `a+b`, a mixture
    of tasks (k3.tasks.mixture)."""
    if "+" in name:  # a mixture (k3.tasks.mixture); each part takes the options its task has

        def part(n: str) -> Task:
            known = {f.name for f in fields(type(make_task(n.partition("@")[0])))}
            return make_task(n, **{k: v for k, v in options.items() if k in known})

        return Mixture(parts=tuple(part(n) for n in name.split("+")))
    if "@" in name:
        base, _, effort = name.partition("@")
        return with_effort(make_task(base, **options), effort)
    if name == "code":
        return CodeTask(**options)
    if name == "calculator":
        return Calculator(**options)
    classes = {
        "arithmetic": Arithmetic,
        "arithmetic-either": EitherWayArithmetic,
        "sort": Sort,
        "recall": Recall,
    }
    if name not in classes:
        raise TaskError(f"unknown task {name!r} (known: {', '.join(TASK_NAMES)})")
    try:
        return classes[name](**options)
    except TypeError as e:
        raise TaskError(f"task {name}: {e}") from None
