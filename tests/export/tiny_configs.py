"""Small configs for the export tests: K3 `tiny`, and a Kimi Linear of the same size.

llama.cpp's kimi-linear reads no `q_lora_rank` and sizes KDA by the attention heads, so the Kimi Linear
config has a single q_proj and as many KDA heads as attention heads.
"""

from __future__ import annotations

from k3.config import K3Config

KIMI_LINEAR_TINY = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "mla_use_nope": True,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "moe_intermediate_size": 32,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 8192,
    "linear_attn_config": {
        "kda_layers": [1, 2, 4],
        "full_attn_layers": [3, 5],
        "num_heads": 2,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    },
}


def kimi_linear_tiny() -> K3Config:
    return K3Config.from_dict(KIMI_LINEAR_TINY)
