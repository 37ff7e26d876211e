"""A stand-in for a native kernel module that counts its calls by name (tests patch it in where the code
under test loads the module): a silent fallback to a general path would pass every equality."""

from __future__ import annotations

import collections
from types import ModuleType


class Counting:
    """`native`, counting its calls by name."""

    def __init__(self, native: ModuleType) -> None:
        self.native, self.calls = native, collections.Counter()

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            self.calls[name] += 1
            return getattr(self.native, name)(*args, **kwargs)

        return call
