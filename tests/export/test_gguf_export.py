"""`k3 export gguf`: the file read back with the `gguf` library (GGUFReader and its dequantizers) against the
checkpoint read with `safetensors`, transformed here from llama.cpp's conventions (not by k3.export).

F32 exports must equal the checkpoint bit for bit; MXFP4 experts must dequantize (gguf's decoder) to the
values of the stored bytes (this file's decoder); BF16 must be exact (the weights are BF16); Q8_0 must
dequantize to within half a quantization step (plus the F16 rounding of the step) of the weights.
"""

from __future__ import annotations

import json
import re

import jinja2
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from typer.testing import CliRunner

from k3.cli import app
from k3.config import K3Config
from k3.export.gguf import ExportError, export_gguf

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def decode_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors MXFP4 (element 2j in the low nibble of byte j) -> float64 [out, in]."""
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return E2M1[codes] * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)


def checkpoint_tensors(directory) -> dict[str, np.ndarray]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                short = re.sub(r"^(language_model\.)?(model\.)?", "", name)
                out[short] = t.numpy() if not t.is_floating_point() else t.double().numpy()
    return out


def expected_tensors(directory) -> dict[str, np.ndarray]:
    """GGUF name -> float64 values, from the checkpoint, by llama.cpp's converter's conventions."""
    cfg = K3Config.from_pretrained(directory)
    w = checkpoint_tensors(directory)
    H, n = cfg.kda_num_heads, cfg.num_attention_heads
    dn, dv, L = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    e = {"token_embd.weight": w["embed_tokens.weight"], "output_norm.weight": w["norm.weight"]}
    e["output.weight"] = w["lm_head.weight"]
    if cfg.uses_attn_res:
        e["output_res_score.weight"] = w["output_attn_res_norm.weight"] * w["output_attn_res_proj.weight"][0]
    for i in range(cfg.num_hidden_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        e[b + "attn_norm.weight"] = w[p + "input_layernorm.weight"]
        e[b + "ffn_norm.weight"] = w[p + "post_attention_layernorm.weight"]
        if cfg.uses_attn_res:
            for theirs, ours in (("attn", "self_attention"), ("ffn", "mlp")):
                e[f"{b}{theirs}_res_score.weight"] = (
                    w[f"{p}{ours}_res_norm.weight"] * w[f"{p}{ours}_res_proj.weight"][0]
                )
        a = p + "self_attn."
        if i in cfg.kda_layers:
            for x in "qkv":
                e[f"{b}attn_{x}.weight"] = w[f"{a}{x}_proj.weight"]
                conv = w[f"{a}{x}_conv1d.weight"]  # [P, 1, ks]
                e[f"{b}ssm_conv1d_{x}.weight"] = conv.reshape(1, conv.shape[0], 1, conv.shape[2])
            for ours, theirs in (("f_a_proj", "ssm_f_a"), ("f_b_proj", "ssm_f_b"), ("b_proj", "ssm_beta")):
                e[f"{b}{theirs}.weight"] = w[f"{a}{ours}.weight"]
            a_log = w[a + "A_log"].astype(np.float32)
            a_log = a_log if cfg.kda_gate_lower_bound is None else a_log[:H]
            e[b + "ssm_a"] = -torch.exp(torch.from_numpy(a_log)).double().numpy()
            e[b + "ssm_dt.bias"] = w[a + "dt_bias"]
            if cfg.kda_use_full_rank_gate:
                e[b + "ssm_g.weight"] = w[a + "g_proj.weight"]
            else:
                e[b + "ssm_g_a.weight"], e[b + "ssm_g_b.weight"] = (
                    w[a + "g_a_proj.weight"],
                    w[a + "g_b_proj.weight"],
                )
            e[b + "ssm_norm.weight"] = w[a + "o_norm.weight"]
        else:
            if cfg.q_lora_rank is None:
                e[b + "attn_q.weight"] = w[a + "q_proj.weight"]
            else:
                e[b + "attn_q_a.weight"], e[b + "attn_q_b.weight"] = (
                    w[a + "q_a_proj.weight"],
                    w[a + "q_b_proj.weight"],
                )
                e[b + "attn_q_a_norm.weight"] = w[a + "q_a_layernorm.weight"]
            e[b + "attn_kv_a_mqa.weight"] = w[a + "kv_a_proj_with_mqa.weight"]
            e[b + "attn_kv_a_norm.weight"] = w[a + "kv_a_layernorm.weight"]
            kv_b = w[a + "kv_b_proj.weight"].reshape(n, dn + dv, L)
            e[b + "attn_k_b.weight"] = kv_b[:, :dn].transpose(0, 2, 1)  # [n, L, dn]
            e[b + "attn_v_b.weight"] = kv_b[:, dn:]  # [n, dv, L]
            if cfg.mla_use_output_gate:
                e[b + "attn_gate.weight"] = w[a + "g_proj.weight"]
        e[b + "attn_output.weight"] = w[a + "o_proj.weight"]
        if i < cfg.first_k_dense_replace:
            for x in ("gate", "up", "down"):
                e[f"{b}ffn_{x}.weight"] = w[f"{p}mlp.{x}_proj.weight"]
            continue
        m = p + "block_sparse_moe."
        e[b + "ffn_gate_inp.weight"] = w[m + "gate.weight"]
        e[b + "exp_probs_b.bias"] = w[m + "gate.e_score_correction_bias"]
        for wid, theirs in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
            experts = []
            for x in range(cfg.num_experts):
                q = f"{m}experts.{x}.{wid}."
                if q + "weight_packed" in w:
                    experts.append(decode_mxfp4(w[q + "weight_packed"], w[q + "weight_scale"]))
                else:
                    experts.append(w[q + "weight"])
            e[f"{b}ffn_{theirs}_exps.weight"] = np.stack(experts)
        for x in ("gate", "up", "down"):
            e[f"{b}ffn_{x}_shexp.weight"] = w[f"{m}shared_experts.{x}_proj.weight"]
        if cfg.is_latent_moe:
            e[b + "ffn_routed_down.weight"] = w[m + "routed_expert_down_proj.weight"]
            e[b + "ffn_routed_up.weight"] = w[m + "routed_expert_up_proj.weight"]
            e[b + "ffn_routed_norm.weight"] = w[m + "routed_expert_norm.weight"]
    return e


def read_back(path) -> tuple[dict, dict[str, tuple[str, np.ndarray]]]:
    r = GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in r.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float64)
        tensors[t.name] = (t.tensor_type.name, values.reshape([int(x) for x in reversed(t.shape)]))
    return fields, tensors


@pytest.mark.parametrize("which", ["k3", "kimi_linear"])
def test_f32_export_reads_back_bit_for_bit(which, k3_tiny, kimi_linear_tiny_ckpt, tmp_path):
    ckpt = k3_tiny if which == "k3" else kimi_linear_tiny_ckpt
    export_gguf(ckpt, tmp_path / "m.gguf")
    _, got = read_back(tmp_path / "m.gguf")
    expected = expected_tensors(ckpt)
    assert set(got) == set(expected)
    for name, want in expected.items():
        qtype, values = got[name]
        assert values.shape == want.shape, name
        if name.endswith("_exps.weight") and which == "k3":
            assert qtype == "MXFP4", name
        else:
            assert qtype == "F32", name
        assert np.array_equal(values, want.astype(np.float32).astype(np.float64)), name


def test_experts_f32_equal_the_decoded_mxfp4_bytes(k3_tiny, tmp_path):
    export_gguf(k3_tiny, tmp_path / "mx.gguf")
    export_gguf(k3_tiny, tmp_path / "f32.gguf", experts="f32")
    _, mx = read_back(tmp_path / "mx.gguf")
    _, f32 = read_back(tmp_path / "f32.gguf")
    experts = [n for n in mx if n.endswith("_exps.weight")]
    assert len(experts) == 3 * K3Config.preset("tiny").num_moe_layers
    for name in experts:
        assert (mx[name][0], f32[name][0]) == ("MXFP4", "F32")
        assert np.array_equal(mx[name][1], f32[name][1]), name


def test_bf16_is_exact_and_q8_0_within_half_a_step(k3_tiny, tmp_path):
    expected = expected_tensors(k3_tiny)
    export_gguf(k3_tiny, tmp_path / "bf16.gguf", outtype="bf16")
    export_gguf(k3_tiny, tmp_path / "q8.gguf", outtype="q8_0")
    _, bf16 = read_back(tmp_path / "bf16.gguf")
    _, q8 = read_back(tmp_path / "q8.gguf")
    assert sum(t == "BF16" for t, _ in bf16.values()) > 50 and sum(t == "Q8_0" for t, _ in q8.values()) > 50
    for name, want in expected.items():
        assert np.array_equal(bf16[name][1], want.astype(np.float32).astype(np.float64)), name
        qtype, values = q8[name]
        if qtype == "Q8_0":  # blocks of 32 along a row, step d = max |x| / 127, d stored as F16
            blocks = want.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            err = np.abs(values.reshape(-1, 32) - blocks)  # rounding (d / 2) + F16 error of d (2^-11) * 127
            assert (err <= (0.5 + 127 * 2.0**-11) * step + 1e-12).all(), name
        elif qtype == "F16":  # rows Q8_0 cannot take (attn_k_b: 16 wide)
            assert np.array_equal(values, want.astype(np.float16).astype(np.float64)), name
        else:
            assert qtype in ("F32", "MXFP4") and np.array_equal(values, want.astype(np.float32)), name


def test_metadata(k3_tiny, kimi_linear_tiny_ckpt, tmp_path):
    export_gguf(k3_tiny, tmp_path / "k3.gguf")
    f, _ = read_back(tmp_path / "k3.gguf")
    raw = json.loads((k3_tiny / "config.json").read_text())["text_config"]
    a = "kimi-k3."
    assert f["general.architecture"] == "kimi-k3"
    assert f["general.file_type"] == 38  # MOSTLY_MXFP4_MOE
    assert f[a + "block_count"] == raw["num_hidden_layers"]
    assert f[a + "attention.head_count_kv"] == [0, 0, 0, 1, 1]  # layers 1-3 KDA, 4-5 MLA
    assert f[a + "attention.layer_norm_rms_epsilon"] == pytest.approx(raw["rms_norm_eps"])
    assert f[a + "kda.gate_lower_bound"] == raw["linear_attn_config"]["gate_lower_bound"]
    assert f[a + "kda.head_dim"] == raw["linear_attn_config"]["head_dim"]
    assert f[a + "attn_res.block_size"] == raw["attn_res_block_size"]
    assert f[a + "activation.situ_beta"] == raw["activation_situ_beta"]
    assert f[a + "activation.situ_linear_beta"] == raw["activation_situ_linear_beta"]
    assert f[a + "expert_latent_length"] == raw["routed_expert_hidden_size"]
    assert f[a + "attention.q_lora_rank"] == raw["q_lora_rank"]
    assert f[a + "attention.key_length_mla"] == raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    assert f[a + "expert_gating_func"] == 2 and f[a + "expert_weights_norm"] is True
    ranks = len((k3_tiny / "tiktoken.model").read_text().splitlines())
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == raw["vocab_size"] and len(f["tokenizer.ggml.merges"]) == ranks - 256
    specials = json.loads((k3_tiny / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    eos = next(int(i) for i, s in specials.items() if s["content"] == "[EOS]")
    assert f["tokenizer.ggml.eos_token_id"] == eos and tokens[eos] == "[EOS]"
    assert f["tokenizer.ggml.pre"] == "kimi-k2" and f["tokenizer.ggml.model"] == "gpt2"
    assert "<|end_of_msg|>" in f["tokenizer.chat_template"]
    export_gguf(kimi_linear_tiny_ckpt, tmp_path / "kl.gguf")
    f, _ = read_back(tmp_path / "kl.gguf")
    assert f["general.architecture"] == "kimi-linear" and f["general.file_type"] == 0
    assert f["kimi-linear.attention.head_count_kv"] == [0, 0, 1, 0, 1]
    assert "kimi-linear.attention.q_lora_rank" not in f and "kimi-linear.attn_res.block_size" not in f


def test_cli_and_errors(k3_tiny, tmp_path):
    runner = CliRunner()
    out = tmp_path / "m.gguf"
    result = runner.invoke(app, ["export", "gguf", str(k3_tiny), str(out), "--outtype", "bf16"])
    assert result.exit_code == 0, result.output
    assert "kimi-k3" in result.output and out.exists()
    again = runner.invoke(app, ["export", "gguf", str(k3_tiny), str(out)])
    assert again.exit_code != 0 and "exists" in again.output
    bad = runner.invoke(app, ["export", "gguf", str(k3_tiny), str(tmp_path / "x.gguf"), "--outtype", "q4_k"])
    assert bad.exit_code != 0 and "--outtype" in bad.output
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ExportError, match="--experts"):
        export_gguf(k3_tiny, tmp_path / "y.gguf", experts="q4")
    with pytest.raises(ExportError, match="not a checkpoint directory"):
        export_gguf(tmp_path / "missing", tmp_path / "y.gguf")


def test_chat_template_renders_the_k3_chat_format():
    from k3.chat.encoder import render_chat
    from k3.export.vocab import CHAT_TEMPLATE

    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    chats = [
        [{"role": "user", "content": "Hola"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": 'a "quote" <|close|>'},
         {"role": "assistant", "content": "Sí."}, {"role": "user", "content": "¿Y?"}],
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "sum"},
         {"role": "assistant", "content": "", "reasoning_content": "  "}, {"role": "user", "content": ""}],
    ]  # fmt: skip
    for chat in chats:
        for prompt in (True, False):
            want = render_chat(chat, add_generation_prompt=prompt)
            assert template.render(messages=chat, add_generation_prompt=prompt) == want


def test_an_interrupted_export_resumes_at_its_first_unfinished_tensor(k3_tiny, tmp_path, monkeypatch):
    """An export stopped while writing a tensor (as SIGKILL would stop it: nothing cleaned up) and run again
    writes only the tensors from that one on, and the file is the uninterrupted export's, byte for byte. A
    checkpoint touched in between starts the export afresh."""
    import shutil

    from k3.export import gguf as export

    whole = export_gguf(k3_tiny, tmp_path / "whole.gguf").path.read_bytes()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(k3_tiny, ckpt)
    tofile, written = export._Streamed.tofile, []

    def stop_at_the_seventh(self, f):
        if len(written) == 6:
            f.write(b"\x01" * (self.nbytes // 2))  # half a tensor, then the process is gone
            raise KeyboardInterrupt
        written.append(self.planned.name)
        tofile(self, f)

    monkeypatch.setattr(export._Streamed, "tofile", stop_at_the_seventh)
    out = tmp_path / "m.gguf"
    with pytest.raises(KeyboardInterrupt):
        export_gguf(ckpt, out)
    assert not out.exists() and (tmp_path / "m.gguf.tmp").exists()

    def counted(self, f):
        written.append(self.planned.name)
        tofile(self, f)

    monkeypatch.setattr(export._Streamed, "tofile", counted)
    first_six = written[:]
    report = export_gguf(ckpt, out)
    resumed = written[6:]
    assert out.read_bytes() == whole and report.tensors == 6 + len(resumed)
    assert resumed[0] not in first_six and len(set(resumed) | set(first_six)) == report.tensors
    assert not list(tmp_path.glob("m.gguf.*"))

    written.clear()  # again, killed after six; the checkpoint changes; the next run starts from the first
    monkeypatch.setattr(export._Streamed, "tofile", stop_at_the_seventh)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(ckpt, tmp_path / "n.gguf")
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text() + "\n")
    monkeypatch.setattr(export._Streamed, "tofile", counted)
    written.clear()
    export_gguf(ckpt, tmp_path / "n.gguf")
    assert len(written) == report.tensors and (tmp_path / "n.gguf").read_bytes() == whole


def test_the_tensor_data_follow_the_alignment_the_head_announces(k3_tiny, tmp_path, monkeypatch):
    """The data are laid out at the alignment the head's metadata gives (`general.alignment`, 32 unless
    set), not at GGUF's default whatever the head says: with 64 announced, GGUFReader reads every tensor
    as the default export has it."""
    from k3.export import gguf as export

    _, default = read_back(export_gguf(k3_tiny, tmp_path / "32.gguf").path)
    write_metadata = export.write_metadata

    def aligned_to_64(w, *args):
        write_metadata(w, *args)
        w.add_custom_alignment(64)

    monkeypatch.setattr(export, "write_metadata", aligned_to_64)
    fields, got = read_back(export_gguf(k3_tiny, tmp_path / "64.gguf").path)
    assert fields["general.alignment"] == 64
    assert got.keys() == default.keys()
    assert all(got[k][0] == default[k][0] and np.array_equal(got[k][1], default[k][1]) for k in got)
