"""Where a sequence's cache comes from and where it goes: the engine's side of the prefix cache
(k3.engine.prefix_cache) and of kept states (k3.engine.state_store), and the bytes a cache holds.

    cache = start_cache(seq, model, prefix_cache)   # a given state, the deepest stored prefix, or empty
    store_boundary(seq, prefix_cache)               # after each prefill chunk: store at the interval
    keep_final_state(seq, cache, row)               # at the end of a keep_state sequence: seq.state
    cache_bytes_formula(cfg, context)               # one sequence's cache from the config alone
"""

from __future__ import annotations

import torch

from k3.config import K3Config, Mixer
from k3.engine.prefix_cache import PrefixCache
from k3.engine.sequence import Sequence, recorded_experts
from k3.engine.state_store import SequenceState
from k3.model.cache import KDAState, MLAState, ModelCache


def start_cache(seq: Sequence, model: torch.nn.Module, prefix_cache: PrefixCache | None) -> ModelCache:
    """The cache a sequence's prefill starts from: a given state, the prefix cache's deepest stored
    state of its prompt (not for prompt log-probs: they need every position's logits), or empty."""
    if seq.params.prompt_logprobs is not None:
        seq.prompt_logprobs, seq.prompt_top = [None], [None]  # nothing predicts the first token
    if seq.state is not None:
        seq.cached = len(seq.state.tokens)
        cache = seq.state.cache.select([0])  # a copy: the state may serve again
    elif prefix_cache is not None and seq.params.prompt_logprobs is None:
        found = prefix_cache.resume(seq.prompt, model.new_cache(1), seq.record_experts, seq.prompt_images)
        cache, seq.cached, seq.block_key = found.cache, found.tokens, found.key
        if found.experts is not None and found.tokens:
            seq.experts.append(found.experts)
    else:
        cache = model.new_cache(1)
        seq.block_key = None if prefix_cache is None else prefix_cache.root
    seq.prefilled = seq.cached
    return cache


def store_boundary(seq: Sequence, prefix_cache: PrefixCache | None) -> None:
    """At a boundary of the prefix cache, store the state there (see k3.engine.prefix_cache)."""
    pc, end = prefix_cache, seq.prefilled
    if pc is None or seq.block_key is None or not seq.standard_chunks or end % pc.interval:
        return
    experts = recorded_experts(seq)[end - pc.interval : end] if seq.record_experts else None
    ids = seq.prompt[end - pc.interval : end]
    media = seq.prompt_images.media(end - pc.interval, end) if seq.prompt_images else b""
    seq.block_key = pc.add(seq.block_key, ids, seq.cache, end, experts, media)  # type: ignore[arg-type]


def keep_final_state(seq: Sequence, cache: ModelCache, row: int) -> None:
    """At the end of a keep_state sequence: its state (row of cache) becomes `seq.state`."""
    if seq.keep_state:
        n = int(cache.tokens[row])
        seq.state = SequenceState((seq.prompt + seq.output)[:n], cache.select([row]))


def cache_bytes_formula(cfg: K3Config, context: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes of one sequence's cache after `context` tokens, from the config alone.

    KDA layer: 3 conv tails of (ks-1) x P values (model dtype) + the [H, K, V] fp32 state: constant.
    MLA layer: (kv_lora_rank + qk_rope_head_dim) values per token (576 for K3), model dtype.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    n_kda = sum(p.mixer is Mixer.KDA for p in cfg.layer_plan)
    n_mla = cfg.num_hidden_layers - n_kda
    kda = n_kda * (
        3 * (cfg.kda_short_conv_kernel_size - 1) * cfg.kda_proj_size * elt
        + cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
    )
    mla = n_mla * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elt
    return {"kda": kda, "mla": mla, "total": kda + mla}


def row_cache_bytes(cache: ModelCache, row: int) -> dict[str, int]:
    """Bytes one row of a (batched) cache holds for its sequence: KDA state + the MLA positions in use."""
    kda = mla = 0
    for state in cache.layers:
        if isinstance(state, KDAState):
            kda += state.nbytes() // cache.batch_size
        elif isinstance(state, MLAState) and state.latent is not None and state.k_rope is not None:
            per_token = state.latent.shape[-1] * state.latent.element_size()
            per_token += state.k_rope.shape[-1] * state.k_rope.element_size()
            mla += int(state.lengths[row]) * per_token
    return {"kda": kda, "mla": mla, "total": kda + mla}
