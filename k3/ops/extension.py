"""Optional native CPU kernels: one C++ file per op family, built offline, loaded only when current.

A :class:`NativeExtension` names a C++ source and the module it compiles to (through torch's
cpp_extension and setuptools; the ``.so`` lands beside the source and is git-ignored). The digest of
the source is compiled into the module, so a build left over from an older source is detected and
ignored with a warning; so is a CPU without AVX2/FMA. Callers then take their pure-torch path.
Build every extension with ``python -m k3.ops.build`` (``make native``).
"""

from __future__ import annotations

import hashlib
import importlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]  # k3/ops -> the folder holding k3/


@dataclass(frozen=True)
class NativeExtension:
    """A C++ source (``source``, a path inside k3/), the headers it includes from beside it, and the
    importable module it builds (``name``)."""

    name: str
    source: Path
    headers: tuple[Path, ...] = ()

    def source_hash(self) -> str:
        """First 16 hex digits of the SHA-256 of the source and its headers (compiled into the module)."""
        digest = hashlib.sha256()
        for path in (self.source, *self.headers):
            digest.update(path.read_bytes())
        return digest.hexdigest()[:16]

    def load(self) -> ModuleType | None:
        """The compiled module if it is built, current and usable on this CPU, else None."""
        try:
            module = importlib.import_module(self.name)
        except ImportError:
            return None
        if self.source.exists() and module.source_hash != self.source_hash():
            warnings.warn(
                f"{self.name} was built from an older {self.source.name} and is ignored; "
                "rebuild with `python -m k3.ops.build`",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return module if module.cpu_supported() else None

    def setup_extension(self):
        """The setuptools extension that compiles this source (-O3, OpenMP, the source digest)."""
        from torch.utils.cpp_extension import CppExtension

        return CppExtension(
            name=self.name,
            sources=[str(self.source)],
            # AVX2/FMA are enabled per function in the sources, so the modules load on any x86-64 CPU.
            extra_compile_args=["-O3", "-fopenmp", f"-DK3_NATIVE_SOURCE_HASH={self.source_hash()}"],
            extra_link_args=["-fopenmp"],  # resolves to the libgomp torch already loaded
        )
