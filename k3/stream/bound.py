"""The memory a streamed run needs beyond the Python runtime, from the plan and the options (docs/stream.md):

2 x largest dense stage          the stage in use and the next one being read
+ expert ring                    `prefetch_bytes` of experts read ahead (at least one) + the one in use
+ state                          residual streams: 4 bytes x tokens x hidden x (AttnRes blocks + 1),
                                 capped by the memory budget (beyond it the scratch files hold it)
+ activations                    4 bytes x tokens x (16 hidden + 3 latent) + 20 bytes x tokens x k (the
                                 routing and its pairs), + 8 bytes x V per logits row kept, + one expert's
                                 hidden activations: 4 bytes x min(tokens, EXPERT_ROWS) x 2 m
+ vision                         prompts with images: the vision stage as read, plus the tower's fp32 forward
                                 over all their patches (k3.vision.bound); it runs before the layers, so
                                 adding it is conservative
"""

from __future__ import annotations

import math

from k3.stream.layer import EXPERT_ROWS
from k3.stream.plan import StreamPlan
from k3.stream.runner import StreamOptions
from k3.vision.bound import vision_memory_bound
from k3.vision.preprocess import Prepared


def memory_bound(
    plan: StreamPlan,
    options: StreamOptions,
    prompts: list[list[int]],
    images: list[list[Prepared]] | None = None,
) -> dict[str, int]:
    cfg = plan.config
    stages = [plan.embed_rows(sorted({t for p in prompts for t in p})), plan.head, *plan.lm_head]
    stages += [*plan.mixer, *plan.ffn_stages]
    largest = max(s.nbytes for s in stages)
    expert = max((s.nbytes for layer in plan.experts for s in layer.values()), default=0)
    ring = (max(options.prefetch_bytes // max(expert, 1), 1) + 1) * expert
    tokens = sum(map(len, prompts))
    blocks = math.ceil(plan.num_layers / cfg.attn_res_block_size) if cfg.attn_res_block_size else 0
    state = min(4 * tokens * cfg.hidden_size * (blocks + 1), options.memory_budget)
    rows = tokens if options.all_positions else len(prompts)
    L, k = cfg.expert_input_size, cfg.num_experts_per_token
    expert_rows = min(tokens, EXPERT_ROWS) * 2 * cfg.moe_intermediate_size
    activations = 4 * tokens * (16 * cfg.hidden_size + 3 * L) + 20 * tokens * k + 8 * rows * cfg.vocab_size
    activations += 4 * expert_rows
    parts = {"stages": 2 * largest, "expert_ring": ring, "state": state, "activations": activations}
    patches = sum(im.pixels.shape[0] for p in images or [] for im in p)
    if patches and plan.vision is not None and cfg.vision_config is not None:
        tower = vision_memory_bound(cfg.vision_config, patches, cfg.hidden_size)["total"]
        parts["vision"] = plan.vision.nbytes + tower
    return {**parts, "total": sum(parts.values())}
