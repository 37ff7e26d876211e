"""Sandboxes for agents on real isolation: gVisor (`runsc`: its own kernel, memory+fs snapshots) and
bubblewrap (namespaces + seccomp + cgroups: fast stateless checks), with an E2B-shaped API.

The exports load on first use, so registering `k3 sandbox` in the CLI imports none of the backends."""

from k3.lazy import lazy_exports

_EXPORTS = {  # public name -> the module defining it
    "CommandResult": "k3.sandbox.types",
    "EntryInfo": "k3.sandbox.files",
    "Limits": "k3.sandbox.types",
    "Sandbox": "k3.sandbox.sandbox",
    "SandboxError": "k3.sandbox.types",
    "Snapshot": "k3.sandbox.types",
    "default_root": "k3.sandbox.sandbox",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
