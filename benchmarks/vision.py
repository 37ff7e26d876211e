"""Benchmark the vision path: k3's tower + projector against NeMo Automodel 0.7.0's eager copy of the
reference, same random weights and pixels, same run.

Published widths (1024 wide, 12 heads of 128, MLP 4096, projector to 7168), `--layers` of the 27 (all by
default), images of 896x896 (64 x 64 patches, 1,024 tokens) and 1920x1080 (78 x 138 patches, 2,691
tokens), fp32 and bf16 (BF16 weights, fp32 RoPE / norms / softmax, as the reference runs). For each case:
seconds (best of `--repeats`), achieved GFLOP/s and its share of this machine's fp32 GEMM (a 2048^3
torch.mm in the same run), peak RSS of the process that ran it (each case in a fresh process), and the
relative RMS distance between k3's and NeMo's features. Then, with `--ttft`, the time to the first token
of an image chat on a `mini` checkpoint (written to a temporary folder).

FLOPs counted (matmuls only): patch embedding 2 N 588 D; per layer 2 N (3 Q D + Q D + 2 D I) + attention
4 n^2 Q per image (n its patches); projector 2 M (16 D^2 + 4 D T) for M merged tokens.

Run: ``.venv/bin/python benchmarks/vision.py [--layers 27] [--sizes 896x896 1920x1080] [--dtypes fp32
bf16] [--skip-nemo] [--ttft]``. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # NeMo's position-grid helper is torch.compiled

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from k3.ops.roofline import best_seconds, gemm_rate, machine_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def flops(cfg, layers: int, gh: int, gw: int) -> float:
    D, Q, I, T = cfg.vt_hidden_size, cfg.qkv_hidden_size, cfg.vt_intermediate_size, cfg.text_hidden_size
    n, m = gh * gw, gh * gw // 4
    per_layer = 2 * n * (3 * Q * D + Q * D + 2 * D * I) + 4 * n * n * Q
    return 2 * n * 588 * D + layers * per_layer + 2 * m * (16 * D * D + 4 * D * T)


def weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    from k3.config import K3Config
    from k3.layout import vision_tensors

    text = K3Config.preset("k3")
    text.vision_config = cfg
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in vision_tensors(text):
        if len(spec.shape) == 1:
            out[spec.name] = torch.ones(spec.shape)
        else:
            fan_in = 1 if spec.name.endswith("pos_emb.weight") else torch.Size(spec.shape[1:]).numel()
            out[spec.name] = torch.randn(spec.shape, generator=g) / fan_in**0.5
    return out


def one_case(impl: str, size: str, dtype_name: str, layers: int, repeats: int, out: Path) -> None:
    """Runs in its own process: one implementation, one image, one dtype; writes features and a JSON line."""
    from k3.vision.config import VisionConfig
    from k3.vision.preprocess import navit_geometry

    sys.path.insert(0, str(ROOT / "tests" / "vision"))
    cfg = VisionConfig(vt_num_hidden_layers=layers)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    w, h = (int(x) for x in size.split("x"))
    geo = navit_geometry(w, h)
    gh, gw = geo.grid
    pixels = torch.rand(gh * gw, 3, 14, 14, generator=torch.Generator().manual_seed(1)) * 2 - 1
    grids = [(1, gh, gw)]
    ws = {k: v.to(dtype) for k, v in weights(cfg).items()}
    if impl == "k3":
        from helpers import k3_features, k3_modules

        modules = k3_modules(cfg, ws, dtype)
        run = lambda: k3_features(*modules, pixels, grids)  # noqa: E731
    else:
        from nemo_oracle import nemo_features, nemo_modules

        modules = nemo_modules(cfg, ws, dtype)
        run = lambda: nemo_features(*modules, pixels, grids)  # noqa: E731
    with torch.no_grad():
        seconds = best_seconds(run, repeats)
        features = run()[0].float()
    save_file({"features": features.contiguous()}, out.with_suffix(".safetensors"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = {
        "seconds": seconds,
        "gflop": flops(cfg, layers, gh, gw) / 1e9,
        "peak_rss": peak,
        "tokens": geo.tokens,
    }
    out.write_text(json.dumps(row))


def run_case(impl: str, size: str, dtype: str, args, tmp: Path) -> dict | None:
    out = tmp / f"{impl}-{size}-{dtype}.json"
    cmd = [
        sys.executable,
        __file__,
        "--one",
        impl,
        size,
        dtype,
        str(args.layers),
        str(args.repeats),
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  {impl} {size} {dtype}: failed\n{done.stderr[-2000:]}")
        return None
    row = json.loads(out.read_text())
    row["features"] = load_file(out.with_suffix(".safetensors"))["features"]
    return row


def ttft(repeats: int) -> None:
    import base64
    import io
    import tempfile

    import numpy as np
    from PIL import Image

    from k3.config import K3Config
    from k3.engine.chat import chat_prompt
    from k3.engine.generate import Engine
    from k3.engine.images import image_inputs
    from k3.engine.sampling import SamplingParams
    from k3.model import K3ForConditionalGeneration
    from k3.model.init import init_checkpoint
    from k3.tokenizer.build import builtin_tokenizer
    from k3.vision.prompt import image_prompt

    with tempfile.TemporaryDirectory() as tmp:
        init_checkpoint(K3Config.preset("mini"), tmp)
        model = K3ForConditionalGeneration.from_pretrained(tmp)
    tok = builtin_tokenizer(model.config.vocab_size)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    part = {"type": "image_url", "image_url": {"url": url}}
    content = [part, {"type": "text", "text": "What is this?"}]
    message = type("M", (), {"role": "user", "content": content})()

    def first_token() -> None:
        images = image_inputs([message])
        prompts = [image_prompt(im.original, im.tokens) for im in images]
        ids = chat_prompt([{"role": "user", "content": content}], image_prompts=prompts).ids(tok)
        engine = Engine(model)  # a fresh engine: no cached image
        next(engine.stream(ids, SamplingParams(temperature=0, max_tokens=1), images))

    seconds = best_seconds(first_token, repeats)
    print(f"\ntime to first token, image chat on mini (448x448 = 256 image tokens, fp32): {seconds:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--sizes", nargs="+", default=["896x896", "1920x1080"])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-nemo", action="store_true")
    parser.add_argument("--ttft", action="store_true", help="also the time to first token on mini")
    parser.add_argument("--one", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        impl, size, dtype, layers, repeats, out = args.one
        one_case(impl, size, dtype, int(layers), int(repeats), Path(out))
        return
    import tempfile

    gemm = gemm_rate(repeats=3) / 1e9
    print(machine_line())
    print(f"fp32 GEMM 2048^3: {gemm:.1f} GFLOP/s; published widths, {args.layers} of 27 layers")
    print(
        f"{'image':>10} {'tokens':>6} {'dtype':>5} {'impl':>5} {'time s':>8} {'GFLOP/s':>8} {'% GEMM':>7} "
        f"{'peak RSS':>9} {'speed-up':>8} {'rel RMS vs NeMo':>15}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for dtype in args.dtypes:
                rows = {
                    impl: run_case(impl, size, dtype, args, Path(tmp))
                    for impl in ("k3", "nemo")
                    if not (impl == "nemo" and args.skip_nemo)
                }
                for impl, r in rows.items():
                    if r is None:
                        continue
                    rate = r["gflop"] / r["seconds"]
                    nemo = rows.get("nemo")
                    up = f"{nemo['seconds'] / r['seconds']:.2f}x" if impl == "k3" and nemo else ""
                    dist = ""
                    if impl == "k3" and nemo:
                        a, b = r["features"].double(), nemo["features"].double()
                        dist = f"{float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()):.2e}"
                    print(
                        f"{size:>10} {r['tokens']:>6} {dtype:>5} {impl:>5} {r['seconds']:>8.2f} {rate:>8.1f} "
                        f"{100 * rate / gemm:>6.1f}% {r['peak_rss'] / 2**30:>7.2f} G {up:>8} {dist:>15}"
                    )
    if args.ttft:
        ttft(args.repeats)


if __name__ == "__main__":
    main()
