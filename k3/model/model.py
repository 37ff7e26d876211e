"""The K3 language model: embeddings, decoder layers (KDA or MLA mixer, dense or MoE FFN), AttnRes, lm_head.

    from k3.model import K3ForCausalLM
    model = K3ForCausalLM.from_pretrained("ckpt/")          # or a URL, a depth-truncated `layers=N`
    logits = model(input_ids)                                # [B, T, V]
    cache = model.new_cache(batch_size=1)
    logits = model(prompt_ids, cache=cache)                  # prefill, then one token at a time

Module and parameter names follow the published checkpoint: `model.layers.N.self_attn.q_proj.weight` is
`language_model.model.layers.N.self_attn.q_proj.weight` in a K3 checkpoint (and the same without
`language_model.` in a Kimi Linear one).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from k3.config import FFN, K3Config, Mixer
from k3.model import fused as fused_step
from k3.model.attn_res import ResidualStream
from k3.model.cache import LayerState, ModelCache
from k3.model.kda import KDAttention
from k3.model.mla import MLAttention
from k3.model.mlp import MLP
from k3.model.moe import MoE, RoutedExpert, Router
from k3.model.norm import Linear, RMSNorm, as_dtype
from k3.model.tiling import tile_weights, untile_weights
from k3.ops.mxfp4 import MXFP4Linear


class K3DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, index: int, quantized_experts: bool | None = None) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        plan = cfg.layer_plan[index]
        self.index = index
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.uses_attn_res = cfg.uses_attn_res  # the AttnRes read weights before the mixer and the FFN
        if self.uses_attn_res:
            self.self_attention_res_norm, self.self_attention_res_proj = RMSNorm(H, eps), Linear(H, 1)
            self.mlp_res_norm, self.mlp_res_proj = RMSNorm(H, eps), Linear(H, 1)
        self.self_attn: KDAttention | MLAttention = (
            KDAttention(cfg) if plan.mixer is Mixer.KDA else MLAttention(cfg)
        )
        # published names: `mlp.` for the dense layer, `block_sparse_moe.` for MoE layers
        self.is_moe = plan.ffn is not FFN.DENSE
        if not self.is_moe:
            self.mlp = MLP(cfg, H, cfg.intermediate_size)
        else:
            self.block_sparse_moe = MoE(cfg, quantized_experts)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    def forward(
        self,
        stream: ResidualStream,
        state: LayerState | None = None,
        counts: torch.Tensor | None = None,
    ) -> None:
        """Advance the residual stream by this layer (see k3.model.attn_res for the read sites).

        `state`: this layer's KDAState or MLAState (ModelCache.empty builds them from the same layer plan).
        """
        fused = stream.stacked and counts is None and state is not None  # a decode step: try k3.model.fused
        x = self.mixer_read(stream)
        update = fused_step.mixer_update(self.input_layernorm, self.self_attn, x, state) if fused else None
        if update is None:
            update = self.self_attn(self.input_layernorm(x), state, counts)  # type: ignore[arg-type]
        stream.add(update)
        y = self.ffn_read(stream)
        update = fused_step.ffn_update(self.post_attention_layernorm, self.ffn, y) if fused else None
        stream.add(self.ffn(self.post_attention_layernorm(y)) if update is None else update)

    def mixer_read(self, stream: ResidualStream) -> torch.Tensor:
        """The mixer's input [B, T, H] before its norm (closing an AttnRes block where a new one starts)."""
        if self.uses_attn_res:
            return stream.mixer_input(self.index, self.self_attention_res_norm, self.self_attention_res_proj)
        return stream.plain()

    def ffn_read(self, stream: ResidualStream) -> torch.Tensor:
        """The FFN's input [B, T, H] before its norm, read after the mixer's update."""
        return stream.read(self.mlp_res_norm, self.mlp_res_proj) if self.uses_attn_res else stream.plain()

    def mixer_input(self, stream: ResidualStream) -> torch.Tensor:
        """The mixer's normalised input [B, T, H]."""
        return self.input_layernorm(self.mixer_read(stream))

    def ffn_input(self, stream: ResidualStream) -> torch.Tensor:
        """The FFN's normalised input [B, T, H]."""
        return self.post_attention_layernorm(self.ffn_read(stream))


class K3Model(nn.Module):
    """Embeddings, the first `num_layers` decoder layers, the output read and the final norm."""

    def __init__(
        self, cfg: K3Config, num_layers: int | None = None, quantized_experts: bool | None = None
    ) -> None:
        super().__init__()
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        H = cfg.hidden_size
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H, _weight=torch.zeros(cfg.vocab_size, H))
        self.layers = nn.ModuleList(K3DecoderLayer(cfg, i, quantized_experts) for i in range(n))
        self.uses_attn_res = cfg.uses_attn_res  # the AttnRes read weights of the output
        if self.uses_attn_res:
            self.output_attn_res_norm, self.output_attn_res_proj = RMSNorm(H, cfg.rms_norm_eps), Linear(H, 1)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.fast_decode = True  # one-token forwards read the residual stream stacked (attn_res)
        self.one_call_decode = True  # and run a decode step's layers in one native call (k3.model.fused)
        self.decode_plan = fused_step.DecodePlan()  # what those calls take that stays the same between steps

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: ModelCache | None = None,
        lengths: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.float32,
        inputs_embeds: torch.Tensor | None = None,
        *,
        normalized: bool = True,
    ) -> torch.Tensor:
        """input_ids [B, T] -> final hidden states [B, T, hidden], normalised (`normalized=False`: before the
        final norm). `inputs_embeds` [B, T, H]: the input rows instead of the embeddings of input_ids (images
        scattered in: k3.model.multimodal)."""
        if cache is not None and len(cache.layers) != len(self.layers):
            raise ValueError(f"the cache has {len(cache.layers)} layers, the model {len(self.layers)}")
        counts = None if lengths is None else torch.as_tensor(lengths, dtype=torch.long)
        step = self.fast_decode and input_ids.shape[1] == 1
        one_call = self.one_call_decode and counts is None and cache is not None and inputs_embeds is None
        h = None
        if step and one_call and compute_dtype == torch.float32:  # embedding to output read: one native call
            h = fused_step.decoder_layers(self.decode_plan, self, input_ids, cache.layers)
        if h is None:  # the layers one by one (k3.model.fused's per-layer calls on a step)
            embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            embeds = as_dtype(embeds, compute_dtype)
            stream = ResidualStream(embeds, self.config.attn_res_block_size, stacked=step)
            for i, layer in enumerate(self.layers):
                layer(stream, None if cache is None else cache.layers[i], counts)
            h = self.output_read(stream)
        if cache is not None:
            cache.tokens += input_ids.shape[1] if counts is None else counts
        return self.norm(h) if normalized else h

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        self.decode_plan.clear()  # a conversion (`.to`, `.float`) may change the weights' dtypes in place
        return super()._apply(fn, recurse)

    def output_read(self, stream: ResidualStream) -> torch.Tensor:
        """A stream past the last layer read for the output: hidden states [B, T, H] before the final norm."""
        if self.uses_attn_res:
            return stream.read(self.output_attn_res_norm, self.output_attn_res_proj)
        return stream.plain()

    def output(self, stream: ResidualStream) -> torch.Tensor:
        """The final hidden states [B, T, H] of a stream past the last layer: output read, final norm."""
        return self.norm(self.output_read(stream))


class K3ForCausalLM(nn.Module):
    """Ids in, logits out. Build with `from_pretrained` (a checkpoint) or `from_config` (random weights)."""

    loads_vision = False  # the vision tower and projector too (k3.model.multimodal)

    def __init__(
        self,
        cfg: K3Config,
        *,
        num_layers: int | None = None,
        quantized_experts: bool | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        """A model with zero weights (fill it with `load_state_dict`, or use the two constructors below).

        `num_layers`: keep only the first layers. `quantized_experts`: routed experts as MXFP4 buffers
        (default: as the config's quantization_config says) or plain trainable weights.
        """
        super().__init__()
        if num_layers is not None and not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"num_layers must be in 1..{cfg.num_hidden_layers}, got {num_layers}")
        self.config = cfg
        self.compute_dtype = compute_dtype
        self.model = K3Model(cfg, num_layers, quantized_experts)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: ModelCache | None = None,
        *,
        lengths: torch.Tensor | list[int] | None = None,
        logits_to_keep: int = 0,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (the last `logits_to_keep` positions if > 0).

        `cache`: continue the sequences it holds and update it (prefill chunk of any length, or a decode
        step). `lengths` [B]: real tokens per row when rows are right-padded (see k3.model.cache).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if cache is not None and cache.batch_size != input_ids.shape[0]:
            raise ValueError(f"the cache holds {cache.batch_size} sequences, input_ids {input_ids.shape[0]}")
        step = input_ids.shape[1] == 1 and self.model.fast_decode  # the final norm then goes with lm_head
        h = self.model(input_ids, cache, lengths, self.compute_dtype, inputs_embeds, normalized=not step)
        if step:
            logits = fused_step.lm_head_logits(self.lm_head, h, self.model.norm)
            return self.lm_head(self.model.norm(h)) if logits is None else logits
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = (
            fused_step.lm_head_logits(self.lm_head, h) if h.shape[1] == 1 and self.model.fast_decode else None
        )
        return self.lm_head(h) if logits is None else logits

    def routers(self) -> dict[int, Router]:
        """{layer index: its router}, for every MoE layer kept (see k3.model.routing to record or replay)."""
        return {layer.index: layer.block_sparse_moe.gate for layer in self.model.layers if layer.is_moe}

    def set_fast_decode(self, enabled: bool, *, one_call: bool = True) -> K3ForCausalLM:
        """One-token steps through the fused decode paths (default) or the general ones (to compare).
        `one_call=False`: the fused paths layer by layer, each mixer and FFN its own native call, instead of
        the step's layers in one (the same bits; a profiler then sees each piece)."""
        for module in self.modules():
            if isinstance(module, KDAttention | MoE | K3Model):
                module.fast_decode = enabled
        self.model.one_call_decode = one_call
        self.model.decode_plan.clear()  # looked up again at the next step (k3.model.fused.DecodePlan)
        return self

    def set_int8_expert_inputs(self, enabled: bool) -> K3ForCausalLM:
        """MXFP4 routed experts multiply their inputs rounded to int8 per block of 32 (approximate, as
        llama.cpp does; on CPUs with narrow vector units a faster decode step: k3.ops.mxfp4.int8_x) or exactly
        (the default). Plain experts are not affected."""
        for module in self.modules():
            if isinstance(module, RoutedExpert):
                for matrix in (module.w1, module.w3, module.w2):
                    if isinstance(matrix, MXFP4Linear):
                        matrix.int8_inputs = enabled
        return self

    def set_native_activations(self, enabled: bool) -> K3ForCausalLM:
        """MLPs and experts apply their activation in one native pass over all their rows (inference:
        k3.model.activations.fused_gated; within 1e-6 of float64 in fp32, a bf16 result rounded once) or with
        torch's ops (the default, the numbers a model in training, or a frozen copy of it, must give).
        `k3 generate / chat / serve` ask for it."""
        for module in self.modules():
            if isinstance(module, MLP | RoutedExpert):
                module.native_activation = enabled
        return self

    def plain_attention_bytes(self, keys: int, queries: int) -> int:
        """Bytes an MLA layer's plain form takes for a chunk of `queries` queries over `keys` positions, in
        the compute dtype (MLAttention.plain_bytes: the mask too after cached context); 0 without MLA layers.
        The engine asks this a dozen times a chunk: the decoder layers are looked through, not every module
        (K3's experts are tens of thousands)."""
        mixers = (layer.self_attn for layer in self.model.layers)
        mla = next((m for m in mixers if isinstance(m, MLAttention)), None)
        return mla.plain_bytes(keys, queries, self.compute_dtype.itemsize) if mla is not None else 0

    def set_attention_budget(self, nbytes: int) -> K3ForCausalLM:
        """The bytes an MLA layer's plain form may expand a chunk's cached context into; past them it attends
        in the absorbed form (MLAttention.plain_budget). The engine sets its own `attention_budget` here."""
        for module in self.modules():
            if isinstance(module, MLAttention):
                module.plain_budget = nbytes
        return self

    def new_cache(self, batch_size: int = 1) -> ModelCache:
        """An empty cache for `batch_size` sequences."""
        return ModelCache.empty(self.config, batch_size, self.num_layers)

    def dequantize_experts(self, dtype: torch.dtype | None = None) -> K3ForCausalLM:
        """Replace every MXFP4 expert by plain weights (exact dequantized values), e.g. to train them."""
        for module in self.modules():
            if isinstance(module, RoutedExpert):
                module.dequantize(dtype or self.compute_dtype)
        return self

    def tile_weights(self, bf16_products: bool = False) -> int:
        """Lay the BF16 weights out for the decode kernels and copy the fp32 ones together onto huge pages
        (k3.model.tiling: the same logits, bit for bit, and a faster one-token step; inference only, fp32
        computation); returns the bytes tiled or copied. `bf16_products`: lay them out for bf16 dot
        products instead (approximate: the kernels' inputs rounded to bfloat16; a faster step of several
        sequences; CPUs with AVX-512 BF16)."""
        return tile_weights(self, bf16_products)

    def untile_weights(self) -> int:
        """Put tiled weights back in rows (k3.model.tiling); returns the bytes untiled."""
        return untile_weights(self)

    # ---- constructors ------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        source: str | Path,
        *,
        dtype: torch.dtype | None = None,
        layers: int | None = None,
        compute_dtype: torch.dtype | None = None,
        requires_grad: bool = False,
        mirror_dir: Path | None = None,
    ) -> K3ForCausalLM:
        """Load a checkpoint directory or URL (K3 or Kimi Linear layout, or transformers' save_pretrained).

        `dtype`: convert floating weights to it (None: keep the checkpoint's; published F32 tensors stay
        F32); the computation runs in `compute_dtype`, by default `dtype` or fp32. `layers=N`: the first N
        layers, then the output read, the final norm and lm_head. Names and shapes are checked strictly
        (`k3.model.loading.ModelLoadError` lists what is missing, unexpected or mis-shaped). Weights are
        read in place from the memory-mapped shards: nothing is copied unless converted. Weights need no
        gradient (`model(ids)` keeps no copies of them for autograd) unless `requires_grad=True` (training).
        From a URL, the weights are mapped from sparse files in `mirror_dir` (default: the temp folder; a
        local disk, not tmpfs): dense weights fetched at load, routed experts on first use
        (k3.model.on_demand).
        """
        from k3.model.loading import load_model

        return load_model(
            cls,
            source,
            dtype=dtype,
            layers=layers,
            compute_dtype=compute_dtype,
            requires_grad=requires_grad,
            mirror_dir=mirror_dir,
        )

    @classmethod
    def from_config(
        cls,
        cfg: K3Config,
        *,
        seed: int = 0,
        num_layers: int | None = None,
        quantized_experts: bool | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ) -> K3ForCausalLM:
        """Random weights, exactly those `k3 init` writes for `seed` (floating ones in fp32)."""
        from k3.model.init import random_tensors
        from k3.model.loading import assign_tensor, model_name

        with torch.device("meta"):
            model = cls(cfg, num_layers=num_layers, compute_dtype=compute_dtype)
        vision = cls.loads_vision
        for name, tensor in random_tensors(cfg, seed=seed, layers=model.num_layers, vision=vision):
            assign_tensor(
                model, model_name(cfg, name), tensor.float() if tensor.is_floating_point() else tensor
            )
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        if quantized_experts is False:
            model.dequantize_experts()
        return model
