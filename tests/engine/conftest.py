"""Engine tests run tiny models, where torch's intra-op threads cost more than they give (and the CI
machine's cores are shared): one thread while these tests run, restored afterwards."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
