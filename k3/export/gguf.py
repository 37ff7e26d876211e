"""A k3 checkpoint as a GGUF file for llama.cpp (architectures `kimi-linear` and `kimi-k3`).

The file is what llama.cpp's own converter writes for the same checkpoint (its `convert_hf_to_gguf.py`,
`conversion/kimi_linear.py` and `conversion/kimi_k3.py`, as vendored by llama-cpp-python 0.3.36), written
here with the published `gguf` library's `GGUFWriter`. That library (0.19) lacks kimi-k3's keys, so those
are written by their raw names (`kimi-k3.kda.gate_lower_bound`, `kimi-k3.attn_res.block_size`, ...).

Tensors (published name -> GGUF name, `blk.N.` per layer) with these changes of form:

* `A_log` -> `ssm_a` = -exp(A_log) (K3: the first `heads` entries of its flat vector);
  `dt_bias` -> `ssm_dt.bias`;
* KDA convs [P, 1, ks] -> [1, P, 1, ks] (ggml order [ks, 1, P, 1]);
* MLA `kv_b_proj` [n (dn + dv), L] -> `attn_k_b` [n, L, dn] (transposed per head) and `attn_v_b` [n, dv, L];
* AttnRes `*_res_norm.weight * *_res_proj.weight` -> one `*_res_score.weight` vector (F32);
* routed experts stacked [E, out, in]: MXFP4 repacked exactly (compressed-tensors keeps elements 2j, 2j+1 in
  byte j; a ggml block is its scale byte then 16 bytes holding elements j and j + 16), or decoded to F32.

Types follow the converter: F32 for 1-D tensors, norms, the router, the KDA convs and tensors not named
`.weight`; the chosen `outtype` for the rest, Q8_0 falling back to F16 where a row is not a multiple of 32.
The file is written to a temporary name and renamed at the end; an export killed on the way (SIGKILL
included) run again with the same arguments goes on from the first tensor it had not finished.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from k3.checkpoint.traps import special_id
from k3.config import FFN, K3Config, Mixer
from k3.errors import K3Error
from k3.export.vocab import CHAT_TEMPLATE, PRE_TOKENIZER, gguf_vocab
from k3.model import K3ForCausalLM
from k3.ops.mxfp4.codec import dequantize_mxfp4, quantize_mxfp4

Q = gguf.GGMLQuantizationType
OUTTYPES = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0}
EXPERT_FORMATS = ("mxfp4", "f32")
FILE_TYPES = {Q.F32: 0, Q.BF16: 32, Q.Q8_0: 7}  # gguf.LlamaFileType: ALL_F32, MOSTLY_BF16, MOSTLY_Q8_0
MXFP4_MOE_FILE_TYPE = 38  # gguf.LlamaFileType.MOSTLY_MXFP4_MOE
SIGMOID_GATING = 2  # gguf.ExpertGatingFuncType.SIGMOID


class ExportError(K3Error):
    """A checkpoint or an option the GGUF export cannot handle; the message says which."""


@dataclass(frozen=True)
class Planned:
    """One GGUF tensor: its name, numpy shape (ggml's order reversed), type, and how to compute it: as
    slices along the first axis (the experts of a stacked tensor, or the whole tensor as one slice)."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    slices: Callable[[], Iterator[np.ndarray]]  # float32 values (for MXFP4: the ggml blocks), in order

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return tuple(gguf.quant_shape_to_byte_shape(self.shape, self.qtype))

    @property
    def nbytes(self) -> int:
        itemsize = {Q.F32: 4, Q.F16: 2}.get(self.qtype)
        return int(np.prod(self.shape)) * itemsize if itemsize else int(np.prod(self.byte_shape))

    def encoded(self) -> Iterator[np.ndarray]:
        """The slices as written: float32 / float16 arrays for F32 / F16, ggml's bytes (uint8) otherwise."""
        for values in self.slices():
            yield values if self.qtype == Q.MXFP4 else gguf.quants.quantize(values, self.qtype)


def file_head(
    out: Path, cfg: K3Config, checkpoint: Path, file_type: int, plan: list[Planned]
) -> tuple[bytes, int]:
    """The file's first bytes, as GGUFWriter writes them: header, metadata and tensor infos (written to a
    scratch file beside `out`, read back, removed), and the alignment of the tensor data they announce."""
    scratch = out.with_name(out.name + ".head.tmp")
    w = gguf.GGUFWriter(scratch, arch_name(cfg))
    try:
        write_metadata(w, cfg, checkpoint.name, file_type)
        write_vocab(w, checkpoint, cfg)
        for p in plan:
            dtype = np.dtype({Q.F32: np.float32, Q.F16: np.float16}.get(p.qtype, np.uint8))
            shape = p.byte_shape if dtype == np.uint8 else p.shape
            w.add_tensor_info(p.name, shape, dtype, p.nbytes, raw_dtype=p.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        return scratch.read_bytes(), w.data_alignment
    finally:
        w.close()
        scratch.unlink(missing_ok=True)


def files_seen(checkpoint: Path) -> list[tuple[str, int, int]]:
    """Each file of the checkpoint folder: name, size, modification time (what a resumed export checks)."""
    return [
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(checkpoint.iterdir()) if f.is_file()
    ]


def write_tensors(tmp: Path, head: bytes, alignment: int, plan: list[Planned], job: str) -> None:
    """`head`, then every tensor's data at the head's `alignment`, into `tmp`. A `tmp` left by a killed
    export of the same job (its `.job` file: the head's hash and the checkpoint's files) is continued from
    its first tensor not whole, so the hours of a large export are not lost; anything else starts afresh."""
    pad = functools.partial(gguf.GGUFWriter.ggml_pad, n=alignment)
    starts, at = [], pad(len(head))  # each tensor's offset in the file
    for p in plan:
        starts.append(at)
        at += pad(p.nbytes)
    marker = tmp.with_name(tmp.name + ".job")
    same = tmp.is_file() and marker.is_file() and marker.read_text() == job
    have = tmp.stat().st_size if same else 0
    first = next((i for i, p in enumerate(plan) if starts[i] + p.nbytes > have), len(plan))
    if not same:  # the marker goes first and comes back last: it stands for a whole head of this job
        marker.unlink(missing_ok=True)
        tmp.write_bytes(head)
        marker.write_text(job)
    with open(tmp, "r+b") as f:
        f.truncate(starts[first] if first < len(plan) else at)  # zeros: the padding before that tensor
        f.seek(0, os.SEEK_END)
        for p in plan[first:]:
            _Streamed(p).tofile(f)
            f.write(bytes(pad(p.nbytes) - p.nbytes))


class _Streamed:
    """What `GGUFWriter.write_tensor_data` needs of an array (`nbytes`, `tofile`), written slice by slice,
    so that a stacked expert tensor (896 experts in K3) is never whole in memory."""

    def __init__(self, planned: Planned) -> None:
        self.planned, self.nbytes = planned, planned.nbytes

    def tofile(self, f) -> None:
        written = 0
        for part in self.planned.encoded():
            part.tofile(f)
            written += part.nbytes
        if written != self.nbytes:
            raise ExportError(f"{self.planned.name}: wrote {written} bytes, planned {self.nbytes}")


# ---- tensor plan -------------------------------------------------------------------------------------------
def arch_name(cfg: K3Config) -> str:
    return "kimi-k3" if cfg.uses_attn_res or cfg.is_latent_moe else "kimi-linear"


def check_supported(cfg: K3Config) -> None:
    """llama.cpp's kimi-linear has no q_lora_rank and sizes KDA by the attention heads."""
    if arch_name(cfg) == "kimi-linear":
        if cfg.q_lora_rank is not None:
            raise ExportError("q_lora_rank: llama.cpp's kimi-linear reads none (it needs a single q_proj)")
        if cfg.kda_num_heads != cfg.num_attention_heads:
            raise ExportError(
                f"linear_attn_config.num_heads {cfg.kda_num_heads}: llama.cpp's kimi-linear sizes KDA by "
                f"num_attention_heads ({cfg.num_attention_heads})"
            )
    elif not (cfg.uses_attn_res and cfg.kda_use_full_rank_gate and cfg.hidden_act == "situ"):
        raise ExportError(
            "llama.cpp's kimi-k3 needs the whole K3 form: attn_res_block_size, use_full_rank_gate, situ"
        )
    elif cfg.activation_situ_linear_beta is None:
        raise ExportError("activation_situ_linear_beta: null (no cap): llama.cpp's kimi-k3 always caps")


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy()


def tensor_type(name: str, shape: tuple[int, ...], outtype: gguf.GGMLQuantizationType):
    """The converter's rule: F32 for 1-D, norms, router, convs and non-`.weight` tensors."""
    keep_f32 = (
        len(shape) <= 1
        or name.endswith("_norm.weight")
        or not name.endswith(".weight")
        or name.endswith((".ffn_gate_inp.weight", "_conv1d_q.weight", "_conv1d_k.weight", "_conv1d_v.weight"))
    )
    if keep_f32:
        return Q.F32
    if outtype == Q.Q8_0 and shape[-1] % 32:
        return Q.F16  # the converter's fallback when Q8_0 cannot take a row
    return outtype


def mxfp4_blocks(packed: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    """compressed-tensors MXFP4 (packed [out, in/2], scale [out, in/32]) -> ggml blocks [out, in/32 * 17]."""
    p = packed.contiguous().numpy()
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1, 32)  # [out, in/32, 32]
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # element j low nibble, element j + 16 high
    blocks = np.concatenate([scale.contiguous().numpy()[..., None], qs], axis=-1)  # [out, in/32, 17]
    return blocks.reshape(p.shape[0], -1).astype(np.uint8)


def plan_tensors(model: K3ForCausalLM, outtype: gguf.GGMLQuantizationType, experts: str) -> Iterator[Planned]:
    """Every GGUF tensor of `model`, in the order the file lists them."""
    cfg = model.config
    src = model.state_dict()  # memory-mapped checkpoint tensors: nothing is read until written

    def plain(gguf_name: str, k3_name: str, transform: Callable[[np.ndarray], np.ndarray] | None = None):
        t = src[k3_name]
        if transform is None:
            shape, values = tuple(t.shape), lambda: iter([_f32(t)])
        else:  # only small tensors are transformed: their shape comes from transforming zeros
            shape, values = transform(np.zeros(t.shape, np.float32)).shape, lambda: iter([transform(_f32(t))])
        return Planned(gguf_name, shape, tensor_type(gguf_name, shape, outtype), values)

    def product(gguf_name: str, a: str, b: str) -> Planned:
        ta, tb = src[a], src[b]
        return Planned(gguf_name, (ta.shape[0],), Q.F32, lambda: iter([_f32(ta).ravel() * _f32(tb).ravel()]))

    yield plain("token_embd.weight", "model.embed_tokens.weight")
    for plan in cfg.layer_plan:
        i, pre, blk = plan.index, f"model.layers.{plan.index}.", f"blk.{plan.index}."
        yield plain(blk + "attn_norm.weight", pre + "input_layernorm.weight")
        yield plain(blk + "ffn_norm.weight", pre + "post_attention_layernorm.weight")
        if cfg.uses_attn_res:
            for theirs, ours in (("attn", "self_attention"), ("ffn", "mlp")):
                yield product(f"{blk}{theirs}_res_score.weight", f"{pre}{ours}_res_norm.weight",
                              f"{pre}{ours}_res_proj.weight")  # fmt: skip
        a = pre + "self_attn."
        if plan.mixer is Mixer.KDA:
            yield from _kda_tensors(cfg, plain, a, blk)
        else:
            yield from _mla_tensors(cfg, src, plain, a, blk, outtype)
        if plan.ffn is FFN.DENSE:
            for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                yield plain(f"{blk}{theirs}.weight", f"{pre}mlp.{ours}.weight")
        else:
            yield from _moe_tensors(cfg, src, plain, pre + "block_sparse_moe.", blk, i, outtype, experts)
    if cfg.uses_attn_res:
        yield product("output_res_score.weight", "model.output_attn_res_norm.weight",
                      "model.output_attn_res_proj.weight")  # fmt: skip
    yield plain("output_norm.weight", "model.norm.weight")
    yield plain("output.weight", "lm_head.weight")


def _kda_tensors(cfg: K3Config, plain, a: str, blk: str) -> Iterator[Planned]:
    H = cfg.kda_num_heads
    for x in ("q", "k", "v"):
        yield plain(f"{blk}attn_{x}.weight", f"{a}{x}_proj.weight")
        conv = f"{blk}ssm_conv1d_{x}.weight"
        yield plain(conv, f"{a}{x}_conv1d.weight", lambda w: w.reshape(1, w.shape[0], 1, w.shape[-1]))
    yield plain(blk + "ssm_f_a.weight", a + "f_a_proj.weight")
    yield plain(blk + "ssm_f_b.weight", a + "f_b_proj.weight")
    yield plain(blk + "ssm_beta.weight", a + "b_proj.weight")
    # Kimi Linear's A_log is [1, 1, H, 1]; K3's a flat vector of which the first H entries are used
    heads = (lambda x: x) if cfg.kda_gate_lower_bound is None else (lambda x: x[:H])
    yield plain(blk + "ssm_a", a + "A_log", lambda x: -torch.exp(torch.from_numpy(heads(x))).numpy())
    yield plain(blk + "ssm_dt.bias", a + "dt_bias")
    if cfg.kda_use_full_rank_gate:
        yield plain(blk + "ssm_g.weight", a + "g_proj.weight")
    else:
        yield plain(blk + "ssm_g_a.weight", a + "g_a_proj.weight")
        yield plain(blk + "ssm_g_b.weight", a + "g_b_proj.weight")
    yield plain(blk + "ssm_norm.weight", a + "o_norm.weight")
    yield plain(blk + "attn_output.weight", a + "o_proj.weight")


def _mla_tensors(cfg: K3Config, src, plain, a: str, blk: str, outtype) -> Iterator[Planned]:
    n, dn, dv, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        yield plain(blk + "attn_q.weight", a + "q_proj.weight")
    else:
        yield plain(blk + "attn_q_a.weight", a + "q_a_proj.weight")
        yield plain(blk + "attn_q_a_norm.weight", a + "q_a_layernorm.weight")
        yield plain(blk + "attn_q_b.weight", a + "q_b_proj.weight")
    yield plain(blk + "attn_kv_a_mqa.weight", a + "kv_a_proj_with_mqa.weight")
    yield plain(blk + "attn_kv_a_norm.weight", a + "kv_a_layernorm.weight")
    kv_b = src[a + "kv_b_proj.weight"]  # [n (dn + dv), L]

    def k_b() -> np.ndarray:  # [n, L, dn]
        return np.ascontiguousarray(_f32(kv_b).reshape(n, dn + dv, L)[:, :dn].transpose(0, 2, 1))

    def v_b() -> np.ndarray:  # [n, dv, L]
        return np.ascontiguousarray(_f32(kv_b).reshape(n, dn + dv, L)[:, dn:])

    for name, shape, fn in (
        (f"{blk}attn_k_b.weight", (n, L, dn), k_b),
        (f"{blk}attn_v_b.weight", (n, dv, L), v_b),
    ):
        yield Planned(name, shape, tensor_type(name, shape, outtype), lambda fn=fn: iter([fn()]))
    if cfg.mla_use_output_gate:
        yield plain(blk + "attn_gate.weight", a + "g_proj.weight")
    yield plain(blk + "attn_output.weight", a + "o_proj.weight")


def _stacked_experts(
    src, prefixes: list[str], packed: bool, as_mxfp4: bool
) -> Callable[[], Iterator[np.ndarray]]:
    """The experts of one matrix, [out, in] each, in order: ggml MXFP4 blocks, or float32 values."""

    def one(prefix: str) -> np.ndarray:
        if packed and as_mxfp4:  # the stored bytes, repacked
            return mxfp4_blocks(src[prefix + "weight_packed"], src[prefix + "weight_scale"])
        if packed:  # exactly decoded
            return dequantize_mxfp4(src[prefix + "weight_packed"], src[prefix + "weight_scale"]).numpy()
        if as_mxfp4:  # plain experts quantized by k3's OCP quantizer
            return mxfp4_blocks(*quantize_mxfp4(src[prefix + "weight"].float()))
        return _f32(src[prefix + "weight"])

    return lambda: (one(p) for p in prefixes)


def _moe_tensors(cfg: K3Config, src, plain, m: str, blk: str, i: int, outtype, experts) -> Iterator[Planned]:
    yield plain(blk + "ffn_gate_inp.weight", m + "gate.weight")
    yield plain(blk + "exp_probs_b.bias", m + "gate.e_score_correction_bias")
    E, packed = cfg.num_experts, f"{m}experts.0.w1.weight_packed" in src
    fmt = experts or ("mxfp4" if packed else None)
    for w, theirs in (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps"), ("w3", "ffn_up_exps")):
        prefixes = [f"{m}experts.{e}.{w}." for e in range(E)]
        m_, latent = cfg.moe_intermediate_size, cfg.expert_input_size
        shape = (E, latent, m_) if w == "w2" else (E, m_, latent)  # [E, out, in]
        name = f"{blk}{theirs}.weight"
        if fmt == "mxfp4":
            qtype = Q.MXFP4
        else:
            qtype = Q.F32 if fmt == "f32" else tensor_type(name, shape, outtype)
        yield Planned(name, shape, qtype, _stacked_experts(src, prefixes, packed, fmt == "mxfp4"))
    if cfg.num_shared_experts:
        for x in ("gate", "up", "down"):
            yield plain(f"{blk}ffn_{x}_shexp.weight", f"{m}shared_experts.{x}_proj.weight")
    if cfg.is_latent_moe:
        yield plain(blk + "ffn_routed_down.weight", m + "routed_expert_down_proj.weight")
        if cfg.latent_moe_use_norm:
            yield plain(blk + "ffn_routed_norm.weight", m + "routed_expert_norm.weight")
        yield plain(blk + "ffn_routed_up.weight", m + "routed_expert_up_proj.weight")


# ---- metadata ----------------------------------------------------------------------------------------------
def write_metadata(w: gguf.GGUFWriter, cfg: K3Config, name: str, file_type: int) -> None:
    """The keys llama.cpp's converter writes for `cfg` (same names, types and values)."""
    arch = w.arch
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    # MLA is served as MQA with one large head; 0 marks a KDA (recurrent) layer
    w.add_head_count_kv([0 if p.mixer is Mixer.KDA else 1 for p in cfg.layer_plan])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_token)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_uint32(f"{arch}.expert_gating_func", SIGMOID_GATING)
    w.add_file_type(file_type)
    w.add_vocab_size(cfg.vocab_size)
    w.add_ssm_conv_kernel(cfg.kda_short_conv_kernel_size)
    w.add_kda_head_dim(cfg.kda_head_dim)
    if cfg.kda_gate_lower_bound is not None:
        w.add_float32(f"{arch}.kda.gate_lower_bound", cfg.kda_gate_lower_bound)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_rope_dimension_count(cfg.qk_rope_head_dim)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)  # the cached latent and k_rope
    w.add_value_length(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.num_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if arch == "kimi-k3":
        w.add_expert_weights_norm(cfg.moe_renormalize and cfg.num_experts_per_token > 1)  # as the release
        if cfg.is_latent_moe:
            w.add_uint32(f"{arch}.expert_latent_length", cfg.expert_input_size)
        w.add_float32(f"{arch}.activation.situ_beta", cfg.activation_situ_beta)
        w.add_float32(f"{arch}.activation.situ_linear_beta", cfg.activation_situ_linear_beta)
        w.add_uint32(f"{arch}.attn_res.block_size", cfg.attn_res_block_size)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_vocab(w: gguf.GGUFWriter, directory: Path, cfg: K3Config) -> None:
    """The tokenizer, its special ids and the chat template. The end-of-sequence id is the config's
    `eos_token_id` when it names a special token (K3 ends turns with <|end_of_msg|>), else the tokenizer's
    [EOS] (the 0.40B's config says 2, an ordinary token: k3.checkpoint.traps)."""
    v = gguf_vocab(directory, cfg.vocab_size)
    eos = special_id(
        cfg.extra.get("eos_token_id", cfg.outer_extra.get("eos_token_id")), v.eos_id, cfg.vocab_size
    )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE_TOKENIZER)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    w.add_token_merges(v.merges)
    w.add_bos_token_id(v.bos_id)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


# ---- the file ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportReport:
    path: Path
    arch: str
    tensors: int
    nbytes: int
    types: dict[str, int]  # GGML type name -> tensors of that type


def export_gguf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    outtype: str = "f32",
    experts: str | None = None,
    overwrite: bool = False,
) -> ExportReport:
    """Write the GGUF of a local checkpoint directory (weights, config.json and tokenizer).

    `outtype`: f32, bf16 or q8_0 for the weight matrices. `experts`: mxfp4 (the checkpoint's MXFP4 bytes
    repacked, or plain experts quantized with k3's OCP quantizer) or f32 (exactly decoded values); by default
    MXFP4 experts stay MXFP4 and plain ones follow `outtype`.
    """
    if outtype not in OUTTYPES:
        raise ExportError(f"--outtype: {outtype!r} is not one of {', '.join(OUTTYPES)}")
    if experts is not None and experts not in EXPERT_FORMATS:
        raise ExportError(f"--experts: {experts!r} is not one of {', '.join(EXPERT_FORMATS)}")
    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint}: not a checkpoint directory")
    if out.exists() and not overwrite:
        raise ExportError(f"{out}: exists (--overwrite replaces it)")
    model = K3ForCausalLM.from_pretrained(checkpoint)  # memory-mapped: nothing is read yet
    cfg = model.config
    check_supported(cfg)
    plan = list(plan_tensors(model, OUTTYPES[outtype], experts))
    mxfp4 = any(p.qtype == Q.MXFP4 for p in plan)
    file_type = MXFP4_MOE_FILE_TYPE if mxfp4 else FILE_TYPES[OUTTYPES[outtype]]
    tmp = out.with_name(out.name + ".tmp")
    head, alignment = file_head(out, cfg, checkpoint, file_type, plan)
    job = json.dumps({"head": hashlib.sha256(head).hexdigest(), "checkpoint": files_seen(checkpoint)})
    write_tensors(tmp, head, alignment, plan, job)
    os.replace(tmp, out)
    tmp.with_name(tmp.name + ".job").unlink(missing_ok=True)
    types: dict[str, int] = {}
    for p in plan:
        types[p.qtype.name] = types.get(p.qtype.name, 0) + 1
    return ExportReport(out, arch_name(cfg), len(plan), out.stat().st_size, types)
