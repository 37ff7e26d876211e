"""Bounded memory, measured by the kernel: a checkpoint several times larger than a memory cgroup's limit,
streamed inside it (swap off, the checkpoint's page cache dropped first), from disk and over HTTP; and
loaded with `from_pretrained(url)` (dense weights at load, experts on first use, mapped from a local mirror
file) and run. Reading every tensor into anonymous memory, as `from_pretrained(url)` used to, is OOM-killed
under the same limit. The limit is the child's own usage after warm-up plus ALLOWANCE."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from k3.checkpoint import open_checkpoint, save_checkpoint
from k3.checkpoint.serve import RangeServer
from k3.config import K3Config
from k3.layout import published_tensors
from k3.model import K3ForCausalLM
from k3.model.init import _generator, draw, init_checkpoint
from k3.stream.bound import memory_bound
from k3.stream.cgroup import MemoryCgroup, drop_page_cache, swap_is_off
from k3.stream.plan import StreamPlan
from k3.stream.runner import StreamOptions

ROOT = Path(__file__).resolve().parents[2]
ALLOWANCE = 48 * 2**20
OPTIONS = dict(prefetch_bytes=2**20, memory_budget=2**20)

CHILD = """
import gc, json, os, sys
mode, source, cgroup, files, allowance, warm, prompts, options = sys.argv[1:]
path = lambda name: os.path.join(cgroup, json.loads(files)[name])
with open(path("procs"), "w") as f:
    f.write(str(os.getpid()))
import torch
torch.set_num_threads(1)
from k3.stream.memory import return_freed_memory
assert return_freed_memory()  # as `k3 stream` does
from k3.model import K3ForCausalLM
from k3.stream.api import stream_logits
from k3.stream.runner import StreamOptions
prompts, options = json.load(open(prompts)), StreamOptions(**json.loads(options))  # prompts: a file
stream_logits(warm, [[1, 2, 3]], options)  # warm both paths up: kernels, allocator, imports
with torch.no_grad():
    K3ForCausalLM.from_pretrained(warm)(torch.tensor([[1, 2, 3]]))
gc.collect()
baseline = int(open(path("usage")).read())
with open(path("limit"), "w") as f:
    f.write(str(baseline + int(allowance)))
try:
    with open(path("peak"), "w") as f:
        f.write("0")  # v1 resets the high-water mark; v2 keeps it (an upper bound then)
except OSError:
    pass
if mode == "stream":
    logits = stream_logits(source, prompts, options).outputs["logits"]
elif mode == "eager":  # what from_pretrained(url) did before: every tensor fetched into anonymous memory
    from k3.checkpoint import open_checkpoint
    with open_checkpoint(source) as ckpt:
        tensors = {t.name: ckpt.read(t.name) for t in ckpt.tensors()}
    logits = torch.zeros(len(prompts), 1)
else:
    with torch.no_grad():
        model = K3ForCausalLM.from_pretrained(source, mirror_dir=os.environ["K3_TEST_MIRROR"])
        logits = torch.stack([model(torch.tensor([p]))[0, -1] for p in prompts])
print(json.dumps({"baseline": baseline, "peak": int(open(path("peak")).read()), "logits": logits.tolist()}))
"""


def big_config() -> K3Config:
    """6 layers, 32 latent MXFP4 experts of 0.8 MB per MoE layer: ~140 MB, almost all of it experts."""
    raw = json.loads(json.dumps(K3Config.preset("tiny").to_dict()))
    text = raw["text_config"]
    text.update(
        vocab_size=4096,
        hidden_size=512,
        num_hidden_layers=6,
        intermediate_size=512,
        num_experts=32,
        num_experts_per_token=2,
        num_shared_experts=1,
        moe_intermediate_size=1024,
        routed_expert_hidden_size=512,
        attn_res_block_size=3,
    )
    text["linear_attn_config"].update(
        kda_layers=[1, 2, 3, 5, 6], full_attn_layers=[4], num_heads=4, head_dim=64
    )
    return K3Config.from_dict(raw)


def quick_tensors(cfg: K3Config):
    """As k3 init, but MXFP4 experts as random codes with scale 2^-5 (no fp32 draw and quantization)."""
    gen = torch.Generator().manual_seed(0)
    for spec in published_tensors(cfg):
        if spec.name.endswith(".weight_packed"):
            yield spec.name, torch.randint(0, 256, spec.shape, dtype=torch.uint8, generator=gen)
        elif spec.name.endswith(".weight_scale"):
            yield spec.name, torch.full(spec.shape, 122, dtype=torch.uint8)
        else:
            yield (
                spec.name,
                draw(
                    cfg,
                    spec.name,
                    spec.shape,
                    torch.bfloat16 if spec.dtype == "BF16" else torch.float32,
                    _generator(0, spec.name),
                ),
            )


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("big") / "ckpt"
    save_checkpoint(
        quick_tensors(big_config()), big_config(), out, always_index=True, max_shard_size=50 * 10**6
    )
    return out


def run_in_cgroup(
    mode: str,
    source: str,
    warm: Path,
    prompts: list[list[int]],
    mirror: Path | None = None,
    allowance: int = ALLOWANCE,
) -> tuple[int, dict | None, int]:
    cgroup = MemoryCgroup.create()
    if cgroup is None:
        pytest.skip("no memory cgroup can be created here (needs root and the memory controller)")
    prompts_file = Path(tempfile.mkdtemp()) / "prompts.json"  # a long prompt exceeds one argument's limit
    prompts_file.write_text(json.dumps(prompts))
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "K3_TEST_MIRROR": str(mirror)}
        args = [
            sys.executable,
            "-c",
            CHILD,
            mode,
            source,
            str(cgroup.path),
            json.dumps(cgroup.files),
            str(allowance),
        ]
        args += [str(warm), str(prompts_file), json.dumps(OPTIONS)]
        done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        result = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else None
        return done.returncode, result, cgroup.oom_kills()
    finally:
        cgroup.remove()
        shutil.rmtree(prompts_file.parent)


def test_streaming_and_url_loading_fit_a_limit_eager_reading_does_not(big, checkpoints, tmp_path):
    assert swap_is_off(), "swap would let the ordinary path page out instead of failing"
    total = sum(f.stat().st_size for f in big.iterdir())
    assert total > 2.5 * ALLOWANCE
    prompts = [list(range(1, 60)), list(range(200, 230)), [7, 8, 9]]
    with open_checkpoint(big) as ckpt:
        bound = memory_bound(StreamPlan(ckpt), StreamOptions(**OPTIONS), prompts)
    warm = checkpoints("tiny")
    drop_page_cache(big)
    rc, local, kills = run_in_cgroup("stream", str(big), warm, prompts)
    assert rc == 0 and kills == 0
    with RangeServer(big) as server:
        rc, remote, kills = run_in_cgroup("stream", server.url, warm, prompts)
        assert rc == 0 and kills == 0
        peak = remote["peak"] - remote["baseline"]
        mib = {k: round(v / 2**20, 1) for k, v in bound.items()}
        print(f"checkpoint {total / 2**20:.0f} MiB, limit +{ALLOWANCE / 2**20:.0f} MiB: streamed over HTTP,")
        print(f"peak +{peak / 2**20:.1f} MiB over the warmed-up process; bound (MiB) {mib}")
        assert peak <= bound["total"] + 16 * 2**20  # + allocator slack
        rc, eager, kills = run_in_cgroup("eager", server.url, warm, prompts)
        assert rc != 0 and eager is None and kills >= 1  # OOM-killed: the limit binds
        rc, ordinary, kills = run_in_cgroup("ordinary", server.url, warm, prompts, tmp_path)
        assert rc == 0 and kills == 0  # experts on demand, mapped from a local mirror: no OOM
        grown = (ordinary["peak"] - ordinary["baseline"]) / 2**20
        print(f"from_pretrained(url) + forwards: peak +{grown:.1f} MiB")
    assert local["logits"] == remote["logits"]
    streamed, loaded = torch.tensor(remote["logits"]), torch.tensor(ordinary["logits"])
    assert (streamed - loaded).abs().max() <= 2e-5 * streamed.abs().max()


def wide_config() -> K3Config:
    """KDA, KDA, MLA (the 2nd and 3rd layer MoE) of hidden size 64, with 2 routed experts of 1,024 hidden
    units, both chosen by every token, and no shared expert: a checkpoint of < 1 MB whose ordinary forward
    on a long prompt runs each expert on every token at once ([T, 1024] activations, several of them),
    where the streamed one runs it EXPERT_ROWS tokens at a time. The MLA layer checks that the streamed
    mixer keeps no [chunk, T] attention masks (they took it to +379 MiB at 32,768 tokens)."""
    raw = json.loads(json.dumps(K3Config.preset("tiny").to_dict()))
    text = raw["text_config"]
    text.update(
        num_hidden_layers=3,
        num_experts=2,
        num_experts_per_token=2,
        num_shared_experts=0,
        moe_intermediate_size=1024,
        max_position_embeddings=65536,
    )
    text["linear_attn_config"].update(kda_layers=[1, 2], full_attn_layers=[3])
    return K3Config.from_dict(raw)


def test_long_prompt_activations_fit_a_limit_the_ordinary_forward_does_not(checkpoints, tmp_path):
    """From a local disk: one 32,768-token prompt whose ordinary forward needs over 3x the limit (measured
    outside a cgroup: +703 MiB over the warmed-up process) is OOM-killed; streamed (+124 MiB measured) it
    fits, within the bound, with the ordinary forward's logits (computed here, outside the cgroup)."""
    assert swap_is_off(), "swap would let the ordinary path page out instead of failing"
    wide = tmp_path / "wide"
    init_checkpoint(wide_config(), wide, seed=0)
    allowance = 208 * 2**20
    prompt = torch.randint(0, 1000, (32768,), generator=torch.Generator().manual_seed(0)).tolist()
    with open_checkpoint(wide) as ckpt:
        bound = memory_bound(StreamPlan(ckpt), StreamOptions(**OPTIONS), [prompt])
    assert bound["total"] + 16 * 2**20 <= allowance
    warm = checkpoints("tiny")
    drop_page_cache(wide)
    rc, streamed, kills = run_in_cgroup("stream", str(wide), warm, [prompt], allowance=allowance)
    assert rc == 0 and kills == 0
    peak = streamed["peak"] - streamed["baseline"]
    print(f"limit +{allowance / 2**20:.0f} MiB: streamed peak +{peak / 2**20:.1f} MiB,")
    print(f"bound (MiB) { {k: round(v / 2**20, 1) for k, v in bound.items()} }")
    assert peak <= bound["total"] + 16 * 2**20  # + allocator slack
    rc, ordinary, kills = run_in_cgroup("ordinary", str(wide), warm, [prompt], tmp_path, allowance)
    assert rc != 0 and ordinary is None and kills >= 1  # OOM-killed: the limit binds
    with torch.no_grad():
        reference = K3ForCausalLM.from_pretrained(wide)(torch.tensor([prompt]))[0, -1]
    logits = torch.tensor(streamed["logits"])[0]
    assert (logits - reference).abs().max() <= 2e-5 * reference.abs().max()
