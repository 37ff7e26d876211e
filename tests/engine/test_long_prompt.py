"""A 100k-token prompt on `mini` prefills within a few GB (slow: minutes on 2 cores; `pytest -m slow`)."""

from __future__ import annotations

import resource

import pytest
import torch

from k3.config import K3Config
from k3.engine.generate import Engine, cache_bytes_formula
from k3.engine.sampling import SamplingParams
from k3.model import K3ForCausalLM


@pytest.mark.slow
def test_100k_prompt_on_mini_fits_in_a_few_gb() -> None:
    cfg = K3Config.preset("mini")
    model = K3ForCausalLM.from_config(cfg, seed=0)
    prompt = torch.randint(0, 32000, (100_000,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(model)
    seq = engine.submit(prompt, SamplingParams(temperature=0, max_tokens=2))
    while engine.has_work:
        engine.step()
    assert len(seq.output) == 2
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
    cache = cache_bytes_formula(cfg, 100_001)["total"] / 2**30
    assert peak_gib < 4, f"peak RSS {peak_gib:.2f} GiB (cache alone {cache:.2f} GiB)"
