"""Sandboxes for agents on real isolation: gVisor (`runsc`: its own kernel, memory+fs snapshots) and
bubblewrap (namespaces + seccomp + cgroups: fast stateless checks), with an E2B-shaped API."""

from k3.sandbox.sandbox import Sandbox, default_root
from k3.sandbox.types import CommandResult, Limits, SandboxError, Snapshot
from k3.sandbox.workspace import EntryInfo

__all__ = ["CommandResult", "EntryInfo", "Limits", "Sandbox", "SandboxError", "Snapshot", "default_root"]
