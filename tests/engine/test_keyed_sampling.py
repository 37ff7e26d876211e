"""Position-keyed draws (`SamplingParams.seed_position`): a request that continues a sequence from its n-th
generated token draws what one uninterrupted request drew there; one stream (the default) does not."""

from __future__ import annotations

import dataclasses

import pytest

from k3.config import K3Config
from k3.engine.generate import Engine
from k3.engine.sampling import SamplingError, SamplingParams
from k3.model import K3ForCausalLM


def test_a_keyed_continuation_draws_what_one_request_drew() -> None:
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=2)
    prompt = [5, 77, 300, 12]
    keyed = SamplingParams(temperature=1.0, max_tokens=12, seed=123, seed_position=0)
    whole = Engine(model).generate([prompt], keyed)[0]
    assert len(whole) == 12
    for n in (1, 5, 11):
        rest = dataclasses.replace(keyed, max_tokens=12 - n, seed_position=n)
        assert Engine(model).generate([prompt + whole[:n]], rest)[0] == whole[n:]
    stream = dataclasses.replace(keyed, seed_position=None)
    one = Engine(model).generate([prompt], stream)[0]
    again = Engine(model).generate([prompt + one[:5]], dataclasses.replace(stream, max_tokens=7))[0]
    assert again != one[5:]  # one stream restarts at its first draw: the continuation parts


def test_bad_seed_position() -> None:
    with pytest.raises(SamplingError, match="seed_position"):
        SamplingParams(seed_position=-1)
