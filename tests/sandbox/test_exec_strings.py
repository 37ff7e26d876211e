"""What exec(2) cannot take, said as a SandboxError before anything starts (the SDK had seen
`Code.UNKNOWN: [Errno 7] Argument list too long`): one string over Linux's MAX_ARG_STRLEN, a NUL byte, an
environment name holding '='; and all strings together over ARG_MAX, which only exec itself knows. On both
backends, and the sandbox runs on after each."""

from __future__ import annotations

import os

import pytest

from k3.sandbox import Sandbox, SandboxError
from k3.sandbox.sandbox import MAX_ARG_STRLEN


def test_what_exec_refuses_is_a_clear_error_and_the_sandbox_lives_on(backend, root):
    arg_max = os.sysconf("SC_ARG_MAX")
    many = {f"V{i}": "v" * (MAX_ARG_STRLEN // 2) for i in range(2 * arg_max // MAX_ARG_STRLEN + 2)}
    cases = [  # (cmd, envs, words of the message)
        ("echo ${#X}", {"X": "x" * MAX_ARG_STRLEN}, ["environment variable X", "exec(2)", "stdin"]),
        ("echo " + "y" * MAX_ARG_STRLEN, {}, ["the command has a string", "exec(2)"]),
        ("echo a\0b", {}, ["NUL"]),
        ("echo", {"A=B": "1"}, ["'A=B'", "without '='"]),
        ("echo", {"": "1"}, ["non-empty"]),
        ("echo", {"X": "a\0b"}, ["variable X", "NUL"]),
        ("echo", many, ["larger than exec(2) takes", "stdin"]),  # each string fits, not all of them
    ]
    with Sandbox.create(backend=backend, root=root, timeout=120) as sbx:
        for cmd, envs, words in cases:
            with pytest.raises(SandboxError) as e:
                sbx.commands.run(cmd, envs=envs, timeout=20)
            assert all(w in str(e.value) for w in words), (words, str(e.value)[:200])
            assert sbx.commands.run("echo alive", timeout=20).stdout == "alive\n"
        if backend == "bwrap":  # a command exec refused leaves no cgroup of its own behind
            assert not [d for d in sbx._backend.cgroup.dirs()[0].iterdir() if d.is_dir()]
        fits = "z" * (MAX_ARG_STRLEN - 10)  # just under the limit: runs
        assert sbx.commands.run("echo ${#Z}", envs={"Z": fits}, timeout=20).stdout == f"{len(fits)}\n"
