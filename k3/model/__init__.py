"""The K3 model in PyTorch (spec: docs/spec/K3.md sections 3-4).

Modules, one concept each: `norm` (RMSNorm, Linear), `tiling` (BF16 weights laid out for the decode
kernels), `activations` (SiTU, SiLU-GLU), `kda` (KDA layer), `mla` (gated MLA, plain and absorbed), `moe`
(router, latent MoE, experts), `mlp` (dense MLP), `attn_res` (Block Attention Residuals), `cache` (inference
state), `model` (K3ForCausalLM), `multimodal` (K3 with its vision tower: K3ForConditionalGeneration),
`loading` (from_pretrained), `init` (random weights, `init_checkpoint`), `commands` (`k3 init`).
"""

from k3.lazy import lazy_exports

_EXPORTS = {  # public name -> the module defining it, imported on first use
    "K3DecoderLayer": "k3.model.model",
    "K3ForCausalLM": "k3.model.model",
    "K3ForConditionalGeneration": "k3.model.multimodal",
    "K3Model": "k3.model.model",
    "KDAState": "k3.model.cache",
    "MLAState": "k3.model.cache",
    "ModelCache": "k3.model.cache",
    "ModelLoadError": "k3.model.loading",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
