"""The host side of a command (`Proc`), on plain host processes: a guest supervisor's `MARK killed_by=<why>`
line becomes `stopped_by` and is cut out of stderr, and what the tree wrote after it (k3-exec writes its
line before it kills) is kept; a process that kills itself is reported as ended by itself."""

from __future__ import annotations

from k3.sandbox.process import Proc

MARK = b"k3-exec-0123456789abcdef"


def _run(script: str) -> Proc:
    proc = Proc(
        ["sh", "-c", script], pid=1, timeout=20, output_cap=1 << 20, kill_tree=lambda: None, mark=MARK
    )
    assert proc.wait(30) is not None
    return proc


def test_the_supervisors_line_names_the_limit_and_later_output_is_kept():
    # one write: the line arrives in the middle of one chunk, as under a fork bomb's last messages
    out = _run(f"printf 'before\\n{MARK.decode()} killed_by=pids\\nafter\\n' >&2; exit 137").outcome
    assert (out.stopped_by, out.exit_code, out.stderr) == ("pids", 137, b"before\nafter\n")


def test_a_command_that_kills_itself_has_no_reason():
    out = _run("echo going >&2; kill -9 $$").outcome
    assert (out.stopped_by, out.exit_code, out.stderr) == (None, 137, b"going\n")
