"""The K3 model in PyTorch (spec: ../shared/spec/K3.md sections 3-4).

Modules, one concept each: `norm` (RMSNorm, Linear), `activations` (SiTU, SiLU-GLU), `kda` (KDA layer),
`mla` (gated MLA, plain and absorbed), `moe` (router, latent MoE, experts), `mlp` (dense MLP), `attn_res`
(Block Attention Residuals), `cache` (inference state), `model` (K3ForCausalLM), `loading`
(from_pretrained), `init` (random weights, `init_checkpoint`), `commands` (`k3 init`).
"""

from k3.model.cache import KDAState, MLAState, ModelCache
from k3.model.loading import ModelLoadError
from k3.model.model import K3DecoderLayer, K3ForCausalLM, K3Model

__all__ = [
    "K3DecoderLayer",
    "K3ForCausalLM",
    "K3Model",
    "KDAState",
    "MLAState",
    "ModelCache",
    "ModelLoadError",
]
