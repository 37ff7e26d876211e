from __future__ import annotations

import pytest
from dist_ranks import Ranks


@pytest.fixture(scope="session")
def ranks2():
    pool = Ranks(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ranks4():
    pool = Ranks(4)
    yield pool
    pool.close()
