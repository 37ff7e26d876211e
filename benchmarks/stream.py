"""Benchmark `k3 stream` from a cold page cache: bytes and GB/s against a plain sequential read of the same
files, and against the ordinary memory-mapped forward under the same memory limit; then extrapolate the
full K3 per batch from the measured rates and the published layout.

    python benchmarks/stream.py CKPT [--tokens 1,16,256] [--limit 2GB] [--repeats 2] [--threads N]
                                     [--http] [--compute float32|bfloat16] [--out FILE.json]

Also the device's own rate: the files read with O_DIRECT, 1 and 4 reads in flight (no page cache).

`--http`: both paths read the checkpoint over HTTP from a Range server (k3.checkpoint.serve) that this
process runs on 127.0.0.1 over CKPT, outside the children's memory limit; the ordinary forward is then
`from_pretrained(URL)` (lazy: each tensor fetched when first used), the plain read k3's HTTP client
fetching every file in 256 MB ranges, and the bytes each child read are the server's count.

Also measured in the same run: the multiply-add rates of the model's BF16 `Linear` and of one MXFP4
expert matrix at the checkpoint's shapes, per batch size, and from them the compute a pass should take
(`predicted_compute_seconds`) beside what it took (`summary.seconds_compute`); bytes read against the
formula (dense bytes per pass + the experts touched x bytes per expert); and the most any overlap of
reading and computing could gain over doing them one after the other, `(read + compute) / max(read,
compute)` with the streamed run's own reading and compute seconds: the ordinary forward does them one after
the other (a page fault stops the computation), the streamed run at the same time.

`--compute bfloat16`: both paths compute in bf16 (the kernel rates too), and two more streamed passes of
the shortest prompt, bf16 and fp32, give the distance of bf16's logits from fp32's at every position.

Streamed and ordinary runs alternate, `--repeats` times each, in ABBA order: the disk's speed drifts
over minutes, and on a virtual machine the host may still cache what the guest's dropped page cache
held, which favours whichever path reads second. The best of each is reported, with every time.

Each run is a child process; with root and a memory controller it runs inside a memory cgroup of
`--limit` (the kernel's peak usage is reported). Machine load (`uptime`) is printed beside the figures:
on a shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3.census import census_of  # noqa: E402
from k3.checkpoint.remote import HttpClient, RemoteOptions  # noqa: E402
from k3.checkpoint.serve import RangeServer  # noqa: E402
from k3.ops.doctor import cpu_info  # noqa: E402
from k3.stream.cgroup import MemoryCgroup, drop_page_cache  # noqa: E402
from k3.stream.commands import compute_threads, parse_size  # noqa: E402
from k3.stream.runner import COMPUTE_DTYPES  # noqa: E402

CHILD = """
import json, os, sys, time
mode, ckpt, cgroup, files, limit, tokens, compute, logits_out = sys.argv[1:]
if cgroup:
    with open(os.path.join(cgroup, json.loads(files)["procs"]), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(cgroup, json.loads(files)["limit"]), "w") as f:
        f.write(limit)
import torch
ids = torch.randint(1, 1000, (int(tokens),), generator=torch.Generator().manual_seed(0)).tolist()
start = time.perf_counter()
torch.set_num_threads(int(os.environ["K3_BENCH_THREADS"]))
if mode == "stream":
    from k3.stream.api import stream_logits
    from k3.stream.runner import StreamOptions
    options = StreamOptions(compute=compute, all_positions=bool(logits_out))  # every position: to compare
    streamed = stream_logits(ckpt, [ids], options)
    result = {"summary": streamed.summary}
    if logits_out:
        from safetensors.torch import save_file
        save_file({"logits": streamed.outputs["logits"][0].contiguous()}, logits_out)  # [T, V]
else:
    from k3.model import K3ForCausalLM
    from k3.stream.runner import COMPUTE_DTYPES
    with torch.no_grad():
        model = K3ForCausalLM.from_pretrained(ckpt, compute_dtype=COMPUTE_DTYPES[compute])
        model(torch.tensor([ids]), logits_to_keep=1)
    result = {}
result["seconds"] = time.perf_counter() - start
io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
result["disk_read_bytes"] = int(io["read_bytes"])  # what the kernel read from storage for this process
if cgroup:
    result["cgroup_peak"] = int(open(os.path.join(cgroup, json.loads(files)["peak"])).read())
print(json.dumps(result))
"""


def prompt_ids(tokens: int) -> list[int]:
    """The prompt each child runs (the same draw as in CHILD)."""
    import torch

    return torch.randint(1, 1000, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()


def sequential_read(ckpt: Path) -> dict:
    drop_page_cache(ckpt)
    start, n = time.perf_counter(), 0
    for file in sorted(ckpt.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while chunk := f.read(16 * 2**20):
                n += len(chunk)
    seconds = time.perf_counter() - start
    return {"bytes": n, "seconds": seconds, "GBps": n / seconds / 1e9}


def direct_read(ckpt: Path, threads: int, piece: int = 16 * 2**20) -> dict:
    """The device's own rate: every file read with O_DIRECT (no page cache, no readahead) in `piece`
    reads, `threads` of them in flight: what no schedule reading through the page cache can beat."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(f, o) for f in sorted(ckpt.glob("*.safetensors")) for o in range(0, f.stat().st_size, piece)]
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in {f for f, _ in jobs}}
    buffers = [mmap.mmap(-1, piece) for _ in range(threads)]  # page-aligned, as O_DIRECT needs

    def read(worker: int) -> int:
        n = 0
        for f, offset in jobs[worker::threads]:
            n += os.preadv(fds[f], [buffers[worker]], offset)
        return n

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            n = sum(pool.map(read, range(threads)))
    finally:
        for fd in fds.values():
            os.close(fd)
    seconds = time.perf_counter() - start
    return {"threads": threads, "bytes": n, "seconds": seconds, "GBps": n / seconds / 1e9}


def http_sequential_read(ckpt: Path, url: str) -> dict:
    """Every file of the checkpoint through k3's HTTP client, 256 MB a request."""
    drop_page_cache(ckpt)
    http, piece = HttpClient(RemoteOptions()), 256 * 2**20
    start, n = time.perf_counter(), 0
    try:
        for file in sorted(ckpt.glob("*.safetensors")):
            size = file.stat().st_size
            for offset in range(0, size, piece):
                body, _ = http.get_range(f"{url}/{file.name}", offset, min(piece, size - offset))
                n += len(body)
    finally:
        http.close()
    seconds = time.perf_counter() - start
    return {"bytes": n, "seconds": seconds, "GBps": n / seconds / 1e9, "over": "http"}


def child(
    mode: str,
    ckpt: Path,
    tokens: int,
    limit: int,
    threads: int,
    server: RangeServer | None = None,
    compute: str = "float32",
    logits_out: Path | None = None,
) -> dict:
    """One run of `mode` on a cold page cache, from CKPT or (with `server`) its URL, computing in `compute`;
    with `logits_out` (stream mode), every position's logits [T, V] saved there."""
    drop_page_cache(ckpt)
    if server is not None:
        server.reset_counters()
    cgroup = MemoryCgroup.create()
    try:
        args = [sys.executable, "-c", CHILD, mode, server.url if server is not None else str(ckpt)]
        args += [str(cgroup.path), json.dumps(cgroup.files)] if cgroup else ["", "{}"]
        args += [str(limit), str(tokens), compute, str(logits_out or "")]
        done = subprocess.run(
            args,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "K3_BENCH_THREADS": str(threads)},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return {"failed": done.returncode, "oom_kills": cgroup.oom_kills() if cgroup else None}
        result = json.loads(done.stdout.splitlines()[-1])
        if server is not None:
            result["served_bytes"] = server.bytes_served  # the child's own disk reads are ~0 over HTTP
        return result
    finally:
        if cgroup:
            cgroup.remove()


def compute_params(ckpt: Path) -> dict[str, int]:
    """Weights a token multiplies by, from the plan: dense matrices of the layers (BF16/F32, 2-D), the
    routed experts (MXFP4: 2 weights a byte of `weight_packed`) and lm_head (once per prompt)."""
    from k3.checkpoint import open_checkpoint
    from k3.stream.plan import StreamPlan

    with open_checkpoint(ckpt) as c:
        plan = StreamPlan(c)
        dense = sum(
            t.nbytes // (2 if t.dtype == "BF16" else 4)
            for stage in (*plan.mixer, *plan.ffn_stages)
            for _, t in stage.tensors
            if len(t.shape) == 2 and t.dtype in ("BF16", "F32")
        )
        expert = next(iter(plan.experts[-1].values()))
        expert_params = sum(2 * t.nbytes for name, t in expert.tensors if name.endswith("weight_packed"))
        head_rows = sum(t.shape[0] for stage in plan.lm_head for _, t in stage.tensors)
        cfg = plan.config
        return {
            "dense": dense,
            "expert": expert_params,
            "pairs_per_token": cfg.num_experts_per_token * sum(1 for e in plan.experts if e),
            "lm_head": head_rows * cfg.hidden_size,
            "layer_bytes": plan.layer_bytes,
            "embedding_row_bytes": plan.embed.nbytes // cfg.vocab_size,
            "expert_bytes": expert.nbytes,
        }


def kernel_rates(tokens: list[int], hidden: int, latent: int, moe_hidden: int, compute: str) -> dict:
    """Multiply-adds per second of the model's own layers at the published shapes, per batch size: a BF16
    `Linear` [4 x hidden, hidden] and one MXFP4 expert matrix [moe_hidden, latent] (each token's expert
    rows), both on activations of the `compute` dtype (as the pass runs them)."""
    import torch

    from k3.model.norm import Linear
    from k3.ops.mxfp4 import MXFP4Linear, quantize_mxfp4

    torch.manual_seed(0)
    dense = Linear(hidden, 4 * hidden).to(torch.bfloat16).requires_grad_(False)
    expert = MXFP4Linear(latent, moe_hidden)
    packed, scale = quantize_mxfp4(torch.randn(moe_hidden, latent) * 0.02)
    expert.weight_packed.copy_(packed)
    expert.weight_scale.copy_(scale)
    out = {}
    for n in tokens:
        rates = {}
        for name, layer, k in (("dense", dense, hidden), ("mxfp4", expert, latent)):
            x = torch.randn(n, k).to(COMPUTE_DTYPES[compute])
            with torch.no_grad():
                layer(x)
                start, reps = time.perf_counter(), 0
                while reps < 2 or time.perf_counter() - start < 1.0:
                    layer(x)
                    reps += 1
            seconds = (time.perf_counter() - start) / reps
            params = layer.weight.numel() if name == "dense" else layer.in_features * layer.out_features
            rates[name] = params * n / seconds  # multiply-adds per second
        out[n] = rates
    return out


def predicted_compute(params: dict[str, int], rates: dict, tokens: int) -> float:
    """Seconds of matrix work for one pass of `tokens` tokens (one prompt) at the measured rates."""
    r = rates[tokens]
    return (
        params["dense"] * tokens / r["dense"]
        + params["expert"] * params["pairs_per_token"] * tokens / r["mxfp4"]
        + params["lm_head"] / rates[min(rates)]["dense"]
    )


def macs_per_pass(per_token: int, lm_head: int, tokens: int) -> int:
    """Multiply-adds of one prompt of `tokens` tokens: every layer per token, lm_head for the last one."""
    return per_token * tokens + lm_head


def extrapolate(stream_runs: dict[int, dict], params: dict[str, int], published_dims: bool) -> dict:
    """Full K3 per batch: bytes from the published layout (uniform routing for the experts touched),
    time = bytes / bandwidth; and compute = K3's multiply-adds at the seconds per multiply-add this run's
    streamed pass achieved: only when the checkpoint has the published dimensions (`k3-slice`), else None."""
    k3 = census_of("k3").to_json()
    E, k, moe_layers = k3["experts_per_layer"], k3["experts_per_token"], k3["moe_layers"]
    expert_bytes = k3["disk_bytes_by_format"]["MXFP4"] / k3["routed_experts"]  # every routed expert is MXFP4
    dense = k3["disk_bytes"] - k3["routed_experts"] * expert_bytes
    lm_head = params["lm_head"]  # the same vocabulary and hidden size
    k3_per_token = k3["active_params"] - lm_head  # active parameters exclude the embedding lookup
    slice_per_token = params["dense"] + params["expert"] * params["pairs_per_token"]
    out = {}
    for tokens, run in stream_runs.items():
        touched = E * (1 - (1 - k / E) ** tokens)
        total = dense + moe_layers * touched * expert_bytes
        compute = None
        if "summary" in run and published_dims:
            per_mac = run["summary"]["seconds_compute"] / macs_per_pass(slice_per_token, lm_head, tokens)
            compute = per_mac * macs_per_pass(k3_per_token, lm_head, tokens)
        out[tokens] = {
            "bytes": total,
            "experts_per_layer": touched,
            "seconds_io_nvme_3GBps": total / 3e9,
            "seconds_io_1Gbit": total / 0.125e9,
            "seconds_compute_estimate": compute,
        }
    return out


def best(runs: list[dict]) -> dict:
    """The fastest of the repeats (a failed run only when every repeat failed)."""
    done = [r for r in runs if "seconds" in r]
    return min(done, key=lambda r: r["seconds"]) if done else runs[0]


def describe_stream(run: dict, params: dict[str, int], report: dict, n: int) -> dict:
    """Bytes against the formula, rates, and the overlap bound of one streamed run (in place)."""
    s = run["summary"]
    touched = sum(len(ids) for ids in s["experts_touched_ids"][0].values())
    rows = len(set(prompt_ids(n)))  # the embedding rows read
    run["bytes_formula"] = (
        params["layer_bytes"] + rows * params["embedding_row_bytes"] + touched * params["expert_bytes"]
    )
    run["GBps"] = s["bytes_read"] / run["seconds"] / 1e9
    run["vs_sequential"] = run["GBps"] / report["sequential_read"]["GBps"]
    run["compute_seconds_per_token"] = s["seconds_compute"] / n
    run["predicted_compute_seconds"] = predicted_compute(params, report["kernel_rates"], n)
    run["compute_vs_kernels"] = run["predicted_compute_seconds"] / s["seconds_compute"]  # 1: kernels' rate
    run["peak_rss_GB"] = s["peak_rss_bytes"] / 1e9
    reading, compute = s["seconds_reading"], s["seconds_compute"]  # compute: the run less its waits
    run["overlap_bound"] = (reading + compute) / max(reading, compute)
    return run


def distance_from_float32(ckpt: Path, tokens: int, limit: int, threads: int, args) -> dict:
    """Every position's logits of one streamed pass in `args.compute` against the same pass in float32:
    max |dlogit| / max |logit| (worst position and median), top-1 agreement, mean KL(fp32 || other)."""
    import tempfile

    import torch
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        logits = {}
        for compute in (args.compute, "float32"):
            out = Path(tmp) / f"{compute}.safetensors"
            run = child("stream", ckpt, tokens, limit, threads, compute=compute, logits_out=out)
            if "seconds" not in run:
                return {"failed": run}
            logits[compute] = load_file(out)["logits"].double()  # [T, V]
    ours, exact = logits[args.compute], logits["float32"]
    rel = (ours - exact).abs().amax(-1) / exact.abs().amax(-1)  # [T]
    lp, lq = torch.log_softmax(exact, -1), torch.log_softmax(ours, -1)
    return {
        "compute": args.compute,
        "tokens": tokens,
        "max_rel": float(rel.max()),
        "median_rel": float(rel.median()),
        "top1": float((ours.argmax(-1) == exact.argmax(-1)).double().mean()),
        "mean_kl": float((lp.exp() * (lp - lq)).sum(-1).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", type=Path)
    parser.add_argument("--tokens", default="1,16,256")
    parser.add_argument("--limit", default="2GB")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each path, alternating; best counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: k3 stream's)")
    parser.add_argument("--http", action="store_true", help="both paths over HTTP from a local Range server")
    parser.add_argument(
        "--compute", choices=tuple(COMPUTE_DTYPES), default="float32", help="the passes' activation dtype"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stream.json")
    args = parser.parse_args()
    if args.http:
        with RangeServer(args.ckpt) as server:
            run_benchmark(args, server)
    else:
        run_benchmark(args, None)


def run_benchmark(args: argparse.Namespace, server: RangeServer | None) -> None:
    limit, tokens = parse_size(args.limit), [int(t) for t in args.tokens.split(",")]
    threads = args.threads or compute_threads()
    from k3.config import K3Config

    cfg = K3Config.from_pretrained(args.ckpt)
    published_dims = cfg.hidden_size == K3Config.preset("k3").hidden_size
    report: dict = {
        "cpu": cpu_info()["model"],
        "cpus": os.cpu_count(),
        "threads": threads,
        "uptime": os.popen("uptime").read().strip(),
        "limit": limit,
        "ckpt": str(args.ckpt),
        "source": server.url if server is not None else "local",
    }
    print(f"CPU: {report['cpu']} ({report['cpus']} CPUs), torch threads {threads}, {report['uptime']}")
    params = compute_params(args.ckpt)
    report["compute_params"] = params
    report["compute"] = args.compute
    report["kernel_rates"] = kernel_rates(
        tokens, cfg.hidden_size, cfg.expert_input_size, cfg.moe_intermediate_size, args.compute
    )
    print("multiply-adds per second", report["kernel_rates"], flush=True)
    report["sequential_read"] = (
        sequential_read(args.ckpt) if server is None else http_sequential_read(args.ckpt, server.url)
    )
    print("sequential read", report["sequential_read"], flush=True)
    if server is None:
        report["direct_read"] = [direct_read(args.ckpt, threads) for threads in (1, 4)]
        print("O_DIRECT read, 1 and 4 in flight", report["direct_read"], flush=True)
    report["stream"], report["ordinary"] = {}, {}
    for n in tokens:
        streamed, ordinary = [], []
        for r in range(args.repeats):  # ABBA: whichever runs second may find the bytes in the host's cache
            first, second = ("stream", "ordinary") if r % 2 == 0 else ("ordinary", "stream")
            for mode in (first, second):
                run = child(mode, args.ckpt, n, limit, threads, server, args.compute)
                (streamed if mode == "stream" else ordinary).append(run)
        run = best(streamed)
        if "summary" in run:
            describe_stream(run, params, report, n)
        run["all_seconds"] = [r.get("seconds") for r in streamed]
        report["stream"][n] = run
        print(f"stream {n} tokens", {k: v for k, v in run.items() if k != "summary"}, flush=True)
        report["ordinary"][n] = best(ordinary)
        report["ordinary"][n]["all_seconds"] = [r.get("seconds") for r in ordinary]
        if "seconds" in report["ordinary"][n] and "seconds" in run:
            report["ordinary"][n]["stream_speedup"] = report["ordinary"][n]["seconds"] / run["seconds"]
        print(f"ordinary {n} tokens", report["ordinary"][n], flush=True)
    if args.compute != "float32":
        report["distance_from_float32"] = distance_from_float32(args.ckpt, min(tokens), limit, threads, args)
        print("logits against float32's", report["distance_from_float32"], flush=True)
    report["k3_extrapolated"] = extrapolate(report["stream"], params, published_dims)
    report["uptime_after"] = os.popen("uptime").read().strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report["k3_extrapolated"], indent=2))


if __name__ == "__main__":
    main()
