"""The memory the tower and the projector need for one forward (fp32, no gradient), from the config and the
number of patches (docs/vision.md, "Memory"):

weights      4 B x parameters (the tower and the projector; 447,358,976 in the published config)
pixels       4 B x L x 3 P^2                  the patches, [L, 3, P, P]
activations  4 B x L x (3 D + 5 Q + 2 I)      the peak inside a block's MLP: the block's input (still the
                                              encoder's) and its output after attention, q, k, v and the
                                              rotated q, k (locals of the block), norm1's output, fc0's
                                              output and the GELU's
             or the projector's, if larger:   4 B x (2 L D + 3 (L/4) T)   merged rows, their concatenation,
                                              proj.2's output and the post-norm's two temporaries
workspace    15 % of the activations          GEMM packing, the attention kernel's per-thread blocks and
                                              the allocator (measured: 4-6 % over the terms above, with
                                              freed buffers returned to the system; docs/vision.md)

L patches, D = vt_hidden_size, Q = qkv_hidden_size (heads x head_dim), I = vt_intermediate_size, P =
patch_size, T = the text model's hidden size. Attention is one SDPA call per image (no [L, L] scores), the
RoPE tables are 3 x 4 B x L x head_dim/2. Weights held in BF16 (`vision_dtype=torch.bfloat16`) halve the
first term; activations are then mostly BF16 too, but the bound does not count on it.
"""

from __future__ import annotations

from k3.vision.config import VisionConfig


def vision_params(cfg: VisionConfig, text_hidden: int) -> int:
    """Parameters of the tower and the projector (no biases: k3 refuses configs with them)."""
    D, Q, Iw, P = cfg.vt_hidden_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size, cfg.patch_size
    block = 2 * D + 3 * Q * D + Q * D + 2 * D * Iw
    tower = D * 3 * P * P + cfg.init_pos_emb_height * cfg.init_pos_emb_width * D
    tower += cfg.vt_num_hidden_layers * block + D
    n = cfg.projector_in
    return tower + n * n + n * text_hidden + text_hidden


def vision_memory_bound(cfg: VisionConfig, patches: int, text_hidden: int) -> dict[str, int]:
    """Bytes, by term and in total, for `patches` patches (all images of one call) in fp32."""
    D, Q, Iw, P = cfg.vt_hidden_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size, cfg.patch_size
    L = patches
    tower = 4 * L * (3 * D + 5 * Q + 2 * Iw)
    projector = 4 * (2 * L * D + 3 * (L // 4) * text_hidden)
    parts = {
        "weights": 4 * vision_params(cfg, text_hidden),
        "pixels": 4 * L * 3 * P * P,
        "activations": max(tower, projector),
        "rope": 3 * 4 * L * (cfg.head_dim // 2),
        "workspace": max(tower, projector) * 15 // 100,
    }
    return {**parts, "total": sum(parts.values())}
