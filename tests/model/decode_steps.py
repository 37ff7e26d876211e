"""What the decode-step tests share: sequences prefilled as the engine batches them, and a model whose
weights are stored as BF16 like the published checkpoint's."""

from __future__ import annotations

import torch

from k3.model import K3ForCausalLM
from k3.model.cache import ModelCache


def prefilled(model: K3ForCausalLM, lengths: list[int], seed: int) -> tuple[ModelCache, torch.Tensor]:
    """Sequences of these lengths prefilled one by one and stacked (as the engine batches them), and the
    next token of each [B, 1]."""
    vocab = model.config.vocab_size
    caches = []
    with torch.no_grad():
        for i, n in enumerate(lengths):
            caches.append(model.new_cache(1))
            ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed + i))
            model(ids, caches[-1])
    token = torch.randint(0, vocab, (len(lengths), 1), generator=torch.Generator().manual_seed(seed + 99))
    return ModelCache.stack(caches), token


def with_bf16_weights(model: K3ForCausalLM) -> K3ForCausalLM:
    """Every floating parameter stored as BF16 (matrices, norms, gate constants, convolutions; MXFP4 stays
    packed): the published checkpoint's non-expert weights, and stricter (it keeps a few F32)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.bfloat16()
    return model
