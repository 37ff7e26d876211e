"""Prefill speed of k3 vs transformers, and peak memory of loading checkpoints.

    .venv/bin/python benchmarks/forward.py [--tokens 2048] [--k3-slice] [--skip-rss]

1. Prefill tokens/s on `mini` (fp32, one sequence of --tokens): k3's K3ForCausalLM on the K3 `mini` preset,
   and on the Kimi Linear version of the same sizes (K3 extras off: no AttnRes, no latent MoE, SiLU,
   softplus gate, low-rank output gate, plain experts), against transformers.KimiLinearForCausalLM on that
   same Kimi Linear model (its weights saved with save_pretrained and loaded into k3: the logits are
   compared too), all in the same run.
2. Peak RSS of `K3ForCausalLM.from_pretrained` on `mini` (and `k3-slice` with --k3-slice: ~11 GB written
   to a temporary directory first) in a fresh subprocess: the peak resident set (VmHWM) after the imports
   and a warm-up forward of `tiny`,
   after loading and after a 16-token forward, against the checkpoint's size on disk.
Timings on a shared machine are noisy; the ratio is measured on the same inputs in the same process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3.config import K3Config, Mixer
from k3.model import K3ForCausalLM
from k3.model.init import init_checkpoint

RSS_PROBE = """
import json, re, sys, torch
from k3.model import K3ForCausalLM
def rss():  # this process's peak resident set (VmHWM; ru_maxrss would include the parent's, from fork)
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
from k3.config import K3Config
with torch.no_grad():  # warm up the runtime (thread pools, kernels) so that `base` holds it
    K3ForCausalLM.from_config(K3Config.preset("tiny"))(torch.zeros(1, 4, dtype=torch.long))
base = rss()
model = K3ForCausalLM.from_pretrained(sys.argv[1])
loaded = rss()
with torch.no_grad():
    model(torch.randint(0, model.config.vocab_size, (1, 16)))
print(json.dumps({"base": base, "loaded": loaded, "forward": rss()}))
"""


def kimi_linear_config(cfg: K3Config):
    """transformers' KimiLinearConfig with `cfg`'s sizes and K3's extras off."""
    import transformers

    return transformers.KimiLinearConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        layer_types=[
            "linear_attention" if p.mixer is Mixer.KDA else "full_attention" for p in cfg.layer_plan
        ],
        first_k_dense_replace=cfg.first_k_dense_replace,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_token,
        n_shared_experts=cfg.num_shared_experts,
        n_group=cfg.num_expert_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        linear_num_heads=cfg.kda_num_heads,
        linear_head_dim=cfg.kda_head_dim,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


def timed(fn, repeat: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        with torch.no_grad():
            out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def prefill(tokens: int, repeat: int, workdir: Path) -> None:
    import transformers

    cfg = K3Config.preset("mini")
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    k3_mini = K3ForCausalLM.from_config(cfg, seed=0)
    torch.manual_seed(0)
    oracle = transformers.KimiLinearForCausalLM(kimi_linear_config(cfg)).float().eval()
    oracle.save_pretrained(workdir / "kimi-linear-mini")
    k3_kimi = K3ForCausalLM.from_pretrained(workdir / "kimi-linear-mini")
    with torch.no_grad():  # warm-up (lazy inits, the native kernels)
        for model in (k3_mini, k3_kimi):
            model(ids[:, :64])
        oracle(ids[:, :64])

    # prefill as generation runs it: logits of the last position only (transformers' logits_to_keep=1)
    t_k3, _ = timed(lambda: k3_mini(ids, logits_to_keep=1), repeat)
    t_k3_kimi, ours = timed(lambda: k3_kimi(ids, logits_to_keep=1), repeat)
    t_hf, theirs = timed(lambda: oracle(ids, logits_to_keep=1).logits, repeat)
    diff = (ours - theirs).abs().max().item() / theirs.abs().max().item()
    print(
        f"prefill, {tokens} tokens, fp32, {torch.get_num_threads()} threads (best of {repeat}), last logits:"
    )
    rows = [
        ("k3, K3 mini (MXFP4 experts, AttnRes, latent MoE)", t_k3),
        ("k3, Kimi Linear mini", t_k3_kimi),
        ("transformers KimiLinearForCausalLM, Kimi Linear mini", t_hf),
    ]
    for name, seconds in rows:
        print(f"  {name:54s} {seconds:8.2f} s {tokens / seconds:8.0f} tok/s")
    print(f"  speed-up on the same Kimi Linear model: {t_hf / t_k3_kimi:.1f}x")
    print(f"  K3 mini in k3 vs Kimi Linear mini in transformers: {t_hf / t_k3:.1f}x")
    print(f"  logits max |k3 - transformers| / max |logit| = {diff:.2e}")
    t_full, _ = timed(lambda: k3_kimi(ids), 1)
    t_hf_full, _ = timed(lambda: oracle(ids).logits, 1)
    print(f"  with all {tokens} x {cfg.vocab_size} logits: k3 {t_full:.2f} s, transformers {t_hf_full:.2f} s")


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.suffix in (".safetensors", ".json"))


def peak_rss(preset: str, workdir: Path) -> None:
    out = workdir / preset
    start = time.perf_counter()
    init_checkpoint(K3Config.preset(preset), out, seed=0)
    made = time.perf_counter() - start
    size = checkpoint_bytes(out)
    probe = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, str(out)], capture_output=True, text=True, check=True
    )
    rss = json.loads(probe.stdout.strip().splitlines()[-1])
    gb = 1e9
    print(f"load {preset}: checkpoint {size / gb:.3f} GB (written in {made:.0f} s)")
    for stage in ("loaded", "forward"):
        delta = rss[stage] - rss["base"]
        print(
            f"  after {stage:7s}: peak RSS {rss[stage] / gb:.3f} GB = imports {rss['base'] / gb:.3f} GB"
            f" + {delta / gb:.3f} GB ({delta / size:.2f}x the checkpoint; total {rss[stage] / size:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--k3-slice", action="store_true", help="also load k3-slice (writes ~11 GB)")
    parser.add_argument("--skip-rss", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3-bench-") as tmp:
        work = Path(tmp)
        if not args.skip_prefill:
            prefill(args.tokens, args.repeat, work)
        if not args.skip_rss:
            for preset in ("mini", "k3-slice") if args.k3_slice else ("mini",):
                peak_rss(preset, work)


if __name__ == "__main__":
    main()
