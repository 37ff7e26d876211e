"""`k3 sandbox run | template build | serve | bench`. Register in k3/cli.py with
`app.add_typer(sandbox_app, name="sandbox")`; the sandbox package is imported inside the commands."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import sys
from pathlib import Path

import typer

from k3.terminal import fail

sandbox_app = typer.Typer(help="Sandboxes for agents on gVisor and bubblewrap.", no_args_is_help=True)
template_app = typer.Typer(help="Sandbox templates (read-only roots).", no_args_is_help=True)
sandbox_app.add_typer(template_app, name="template")


def shell_line(cmd: list[str]) -> str:
    """The /bin/sh -c line for `cmd`: one argument as written (`-- 'echo a | wc'`); several quoted one by one,
    so that `-- python3 -c 'print(1)'` runs python3 with the two arguments `-c` and `print(1)`."""
    return cmd[0] if len(cmd) == 1 else shlex.join(cmd)


@sandbox_app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    cmd: list[str] = typer.Argument(
        ..., help="The command after --: one argument is a shell line (/bin/sh -c); several are an argv."
    ),
    backend: str = typer.Option("gvisor", help="gvisor or bwrap."),
    timeout: float = typer.Option(30, help="Seconds before the command's whole process tree is killed."),
    template: str = typer.Option("python", help="A template name or an absolute directory."),
    memory_mb: int = typer.Option(512, help="Memory limit (no swap)."),
    pids: int = typer.Option(64, help="Process limit."),
    cpus: float = typer.Option(0.5, help="CPU quota in cores."),
) -> None:
    """Run one command in a fresh sandbox, print its output and exit with its exit code."""
    from k3.sandbox import Limits, Sandbox, SandboxError

    try:
        limits = Limits(cpus=cpus, memory_mb=memory_mb, pids=pids)
        with Sandbox.create(template=template, backend=backend, limits=limits, timeout=timeout + 60) as sbx:
            r = sbx.commands.run(shell_line(cmd), timeout=timeout)
    except SandboxError as e:
        fail(str(e))
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    if r.killed_by:
        sys.stderr.write(f"k3 sandbox: killed by {r.killed_by} after {r.duration_s:.2f} s\n")
    raise typer.Exit(r.exit_code)


@template_app.command("build")
def template_build(
    name: str = typer.Argument(..., help="The template's name."),
    source: Path = typer.Option(
        None, "--from", help="A directory to copy as the root (default: host files)."
    ),
) -> None:
    """Build (or rebuild) a template under the sandbox state root."""
    from k3.sandbox import SandboxError, default_root
    from k3.sandbox.templates import build_template

    try:
        t = build_template(default_root(), name, source)
    except SandboxError as e:
        fail(str(e))
    binds = ", ".join(t.binds) or "none"
    print(f"template {t.name}: root {t.rootfs}, host directories bound read-only: {binds}")


@sandbox_app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind (127.0.0.1: this machine only)."),
    port: int = typer.Option(8100, help="TCP port."),
    tokens: Path = typer.Option(None, help='JSON file `{"<token>": "<client name>"}`; default: a new token.'),
    quota: int = typer.Option(8, help="Live sandboxes per client."),
    max_ttl: float = typer.Option(3600, help="Longest sandbox lifetime a client may ask for (s)."),
    max_upload_mb: int = typer.Option(256, help="Most MiB in a request's body, a file upload (then 413)."),
    max_limits: str = typer.Option(
        None,
        help="The most a client may ask for a sandbox, as FIELD=VALUE,... over the default ceiling "
        "cpus=2,memory_mb=4096,pids=1024,disk_mb=4096,output_mb=64 (and cpu_s: none).",
    ),
    e2b: bool = typer.Option(
        False, "--e2b", help="Speak E2B's protocol (the `e2b` SDK); k3's API under /k3."
    ),
    backend: str = typer.Option(
        "gvisor", help="With --e2b: the backend of sandboxes whose template names none."
    ),
) -> None:
    """Serve the sandbox API over HTTP; every request needs `Authorization: Bearer <token>` (with --e2b:
    `X-API-KEY`, as the `e2b` SDK sends it). With --e2b the `export E2B_...` lines that point an unchanged
    SDK at this server come first on stdout."""
    from k3.errors import K3Error
    from k3.listen import listening_socket, run_app, url_of

    if max_upload_mb < 1:
        fail(f"--max-upload-mb must be >= 1, got {max_upload_mb}")
    ceiling = _ceiling(max_limits)
    try:
        sock = listening_socket(host, port)
    except K3Error as e:
        fail(str(e))

    from k3.sandbox import SandboxError, default_root
    from k3.sandbox.server import create_app

    if tokens is not None:
        try:
            table = json.loads(tokens.read_text())
        except (OSError, ValueError) as e:
            fail(f"cannot read the tokens file {tokens}: {e}")
        if not isinstance(table, dict) or not table:
            fail(f"the tokens file {tokens} must hold a non-empty JSON object")
    else:
        token = secrets.token_urlsafe(32)
        path = default_root() / "server-token"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        table = {token: "default"}
        if not e2b:
            print(f"bearer token (also in {path}, mode 600): {token}", flush=True)
    try:
        if e2b:
            from k3.sandbox.e2b import create_e2b_app

            app = create_e2b_app(
                table,
                quota=quota,
                max_ttl_s=max_ttl,
                backend=backend,
                max_body_bytes=max_upload_mb * 2**20,
                ceiling=ceiling,
            )
        else:
            app = create_app(
                table, quota=quota, max_ttl_s=max_ttl, max_body_bytes=max_upload_mb * 2**20, ceiling=ceiling
            )
    except SandboxError as e:
        fail(str(e))
    if e2b:
        url = url_of(sock).rstrip("/")
        for line in e2b_exports(next(iter(table)), url):
            print(line)
        print(f"# k3's own API: {url}/k3 (Bearer token = the API key)", flush=True)
    else:
        print(f"sandbox API on {url_of(sock)}", flush=True)
    run_app(app, sock, "warning")


def _ceiling(pairs: str | None):
    """`--max-limits cpus=4,memory_mb=8192`: the default ceiling with those fields changed."""
    from dataclasses import replace

    from k3.sandbox.server import CEILING
    from k3.sandbox.types import Limits, SandboxError

    if pairs is None:
        return CEILING
    values: dict = {}
    for pair in pairs.split(","):
        name, _, text = pair.strip().partition("=")
        try:  # an integer as written stays one; Limits says which fields must be integers
            values[name] = (
                None if text == "none" else int(text) if text.lstrip("-").isdigit() else float(text)
            )
        except ValueError:
            fail(f"--max-limits: {pair.strip()!r} is not FIELD=NUMBER")
    try:
        Limits.from_fields(values)  # the names and values checked
        return replace(CEILING, **values)
    except SandboxError as e:
        fail(f"--max-limits: {e}")


def e2b_exports(api_key: str, url: str) -> list[str]:
    """The environment that points an unchanged `e2b` SDK at `url` (E2B_DEBUG is not used: it would make
    the SDK skip kill and set_timeout)."""
    return [
        f"export E2B_API_KEY={api_key}",
        f"export E2B_API_URL={url}",
        f"export E2B_SANDBOX_URL={url}",
        "export E2B_HTTP_VERSION=1.1",
    ]


@sandbox_app.command()
def bench(
    backend: list[str] = typer.Option(["bwrap", "gvisor"], help="Backends to measure."),
    n: int = typer.Option(5, help="Repetitions per latency."),
    cycles: int = typer.Option(10, help="Create-run-kill cycles per throughput figure."),
) -> None:
    """Time create, run, snapshot, restore, fork and create-run-kill throughput on this machine."""
    from k3.sandbox import SandboxError, default_root
    from k3.sandbox.bench import cycles_per_second, latencies

    load = os.getloadavg()[0]
    try:
        for b in backend:
            lat = latencies(b, n, default_root())
            rates = {w: cycles_per_second(b, w, cycles, default_root()) for w in (1, 2)}
            print(f"== {b} (load average {load:.1f})")
            for op, v in lat.items():
                if isinstance(v, dict):
                    print(f"  {op:16s} p50 {v['p50'] * 1000:8.1f} ms   p95 {v['p95'] * 1000:8.1f} ms")
            print(f"  snapshot size    {lat['snapshot_bytes'] / 1e6:.2f} MB ({lat['snapshot_kind']})")
            print(f"  create-run-kill  {rates[1]:.2f}/s with 1 worker, {rates[2]:.2f}/s with 2")
    except SandboxError as e:
        fail(str(e))
