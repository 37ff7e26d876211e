"""k3 and llama.cpp on the same checkpoint and the same token ids: agreement, per-tensor comparison, greedy
continuations, and speed, each engine in its own process, alternated.

    .venv/bin/python benchmarks/llamacpp.py [--checkpoint DIR | --preset mini] [--work DIR] [--tokens 512]
        [--threshold 1e-3] [--greedy 32] [--skip-agreement]
        [--speed [--threads 1,2] [--prefill 512,2048] [--decode-context 512] [--batch 8] [--weights bf16]]
    .venv/bin/python benchmarks/llamacpp.py --preset k3-slice --work /data/slice --skip-agreement --speed \
        --weights bf16 --prefill 512          # the published dimensions: 11 GB per engine
    .venv/bin/python benchmarks/llamacpp.py ... --alternate-steps 30   # both loaded, decode steps in turn

Needs `llama-cpp-python` (the `llamacpp` extra, never in CI): `pip install llama-cpp-python==0.3.36`
(it compiles llama.cpp: ~30 minutes on 2 cores; that version's llama.cpp, commit 0c1e570, has kimi-linear
and kimi-k3). docs/llamacpp.md says how to build it once and reuse the library.

1. Logits agreement over --tokens random ids (the same ids into both engines): max |dlogit| / max |logit|,
   mean KL(k3 || llama.cpp) per position, top-1 agreement; experts exactly decoded (F32) and MXFP4, with
   llama.cpp's default F16 KV cache and with an F32 one (GGUFs from `k3 export gguf`, weights F32).
2. Per-tensor comparison (F32 cache, F32 experts): every layer's norms, mixer output and FFN output from
   llama.cpp's scheduler eval callback (`cb_eval`, through ctypes) against k3's through forward hooks; the
   first tensor whose max |d| / max |value| exceeds --threshold is printed.
3. Greedy continuations of --greedy tokens after a 16-token prompt, each engine with its own cache.
4. --speed (benchmarks/llamacpp_engine.py, one process per engine and thread count, so two large models never
   share the page cache): prefill tokens/s, decode ms/token after --decode-context tokens, and a decode batch
   of --batch sequences; the decode floor (weight bytes a token reads / the streaming read bandwidth, the
   highest measured before each round and in each engine's process; and each round against the read its own
   process took right after its timings); k3 prefills a prompt in its engine's chunks (`Engine.chunk_size`, as
   `k3 serve` does; `--k3-one-call`: in one call), llama.cpp in one batch; k3 against llama.cpp with its
   default settings, experts MXFP4 in both; `--weights bf16`: every other matrix BF16 in both (k3 computes in
   fp32 on them, or in bf16 with `--k3-compute bf16`: its activations bf16, products in bf16 where the CPU has
   the instructions); `--k3-experts int8` (or `both`, alternated with the exact k3): k3's MXFP4 experts
   multiply inputs rounded to int8 per block of 32 (k3.ops.mxfp4.int8_x), the approximation llama.cpp's MXFP4
   path also makes; `--k3-bf16-products`: k3's decode steps multiply the BF16 weights by inputs rounded to
   bf16 (k3.model.tiling; CPUs with AVX-512 BF16), as llama.cpp rounds its activations for BF16 weights.
5. --alternate-steps N (`alternate`): both engines loaded at once, each in its own process, N decode steps
   of each taken in turn, the read measured after each pair: where the machine's memory bandwidth moves by
   itself, engines timed minutes apart in 4. meet different machines.
The CPU, its SIMD features, the load and the engines' kernels and flags (llama.cpp's with the commit its ggml
reports) are printed: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from k3.config import K3Config
from k3.export.gguf import export_gguf
from k3.model import K3ForCausalLM
from k3.model.init import init_checkpoint
from k3.ops.roofline import machine_line, read_bandwidth
from k3.tokenizer.build import write_tokenizer

GGML_F32, GGML_F16 = 0, 1  # ggml_type values: KV cache types for llama.cpp


# ---- llama.cpp through llama-cpp-python -------------------------------------------------------------------
class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` of the llama.cpp that llama-cpp-python 0.3.36 vendors (ggml/include/ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class TensorDump:
    """Collects named F32 graph tensors through `cb_eval`: name -> numpy array in numpy order [.., ne1, ne0].

    A name seen twice keeps its last value (llama.cpp names the final MoE sum `ffn_out` after its parts)."""

    def __init__(self, wanted: re.Pattern[str]) -> None:
        import llama_cpp

        self.wanted, self.tensors = wanted, {}
        self.callback = llama_cpp.llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)

    def _on_tensor(self, t, ask, user_data) -> bool:
        tensor = ctypes.cast(t, ctypes.POINTER(GgmlTensor)).contents
        name = tensor.name.decode(errors="replace")
        if not self.wanted.fullmatch(name):
            return not ask  # ask: "do you want this one?"
        if ask:
            return True
        if tensor.type == GGML_F32 and tensor.data:
            ne, nb = list(tensor.ne), list(tensor.nb)
            size = sum((ne[i] - 1) * nb[i] for i in range(4)) + 4
            buf = (ctypes.c_char * size).from_address(tensor.data)
            a = np.ndarray(shape=ne[::-1], dtype=np.float32, buffer=buf, strides=nb[::-1]).copy()
            self.tensors[name] = a.reshape(-1, ne[0]) if ne[0] > 1 else a.reshape(-1)
        return True


def llama(path: Path, n_ctx: int, threads: int, cache_type: int, dump: TensorDump | None = None):
    """A llama_cpp.Llama on the GGUF: all logits kept, one ubatch of up to n_ctx tokens."""
    import llama_cpp
    import llama_cpp.llama_cpp as C

    original = C.llama_context_default_params

    def with_callback():  # llama-cpp-python takes no cb_eval argument: set it on the context params
        params = original()
        params.cb_eval = dump.callback
        params.cb_eval_user_data = None
        return params

    if dump is not None:
        C.llama_context_default_params = with_callback
    try:
        return llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=True,
            type_k=cache_type,
            type_v=cache_type,
            verbose=False,
        )
    finally:
        C.llama_context_default_params = original


def llama_logits(model, ids: list[int]) -> np.ndarray:
    model.reset()
    model.eval(ids)
    return np.array(model.scores[: len(ids)], dtype=np.float64)


def llama_greedy(model, prompt: list[int], n: int) -> list[int]:
    model.reset()
    model.eval(prompt)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(model.scores[model.n_tokens - 1])))
        model.eval([out[-1]])
    return out


# ---- k3 ---------------------------------------------------------------------------------------------------
def k3_logits(model: K3ForCausalLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double().numpy()


def k3_greedy(model: K3ForCausalLM, prompt: list[int], n: int) -> list[int]:
    cache = model.new_cache(1)
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache)[0, -1]
        out = []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model(torch.tensor([[out[-1]]]), cache)[0, -1]
    return out


def k3_tensors(model: K3ForCausalLM, ids: list[int]) -> dict[str, np.ndarray]:
    """k3's module outputs under llama.cpp's tensor names (kimi-linear.cpp / kimi-k3.cpp `cb` names)."""
    found: dict[str, np.ndarray] = {}

    def keep(name: str):
        return lambda mod, inp, out: found.__setitem__(name, out.detach()[0].double().numpy())

    hooks = []
    for i, layer in enumerate(model.model.layers):
        mixer = "kda_out" if i in model.config.kda_layers else "mla_out"
        for module, name in (
            (layer.input_layernorm, f"attn_norm-{i}"),
            (layer.self_attn, f"{mixer}-{i}"),
            (layer.post_attention_layernorm, f"ffn_norm-{i}"),
            (layer.ffn, f"ffn_out-{i}"),
        ):
            hooks.append(module.register_forward_hook(keep(name)))
    hooks.append(model.model.norm.register_forward_hook(keep("result_norm")))
    try:
        k3_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return found


# ---- comparisons ------------------------------------------------------------------------------------------
def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict[str, float]:
    """max |d| / max |theirs|, mean KL(softmax ours || softmax theirs), top-1 agreement."""
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    lp = ours - np.logaddexp.reduce(ours, axis=-1, keepdims=True)
    lq = theirs - np.logaddexp.reduce(theirs, axis=-1, keepdims=True)
    kl = (np.exp(lp) * (lp - lq)).sum(-1).mean()
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).mean()
    return {"rel": float(rel), "kl": float(kl), "top1": float(top1)}


def first_parting(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray], threshold: float) -> None:
    def order(name: str) -> tuple[int, int]:
        stem, _, layer = name.rpartition("-")
        kinds = ("attn_norm", "kda_out", "mla_out", "ffn_norm", "ffn_out")
        return (int(layer), kinds.index(stem)) if layer.isdigit() else (10**6, 0)

    print(f"  per tensor (max |d| / max |value|; threshold {threshold:g}):")
    parted = None
    for name in sorted(ours, key=order):
        if name not in theirs:
            print(f"    {name:16s} not in llama.cpp's graph")
            continue
        a, b = ours[name].reshape(theirs[name].shape[0], -1), theirs[name].reshape(theirs[name].shape[0], -1)
        if a.shape != b.shape:
            print(f"    {name:16s} shapes differ: {a.shape} vs {b.shape}")
            continue
        rel = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
        print(f"    {name:16s} {rel:.2e}")
        if parted is None and rel > threshold:
            parted = (name, rel)
    if parted:
        print(f"  FIRST TENSOR BEYOND {threshold:g}: {parted[0]} ({parted[1]:.2e})")
    else:
        print(f"  every compared tensor within {threshold:g}")


# ---- speed ------------------------------------------------------------------------------------------------
ENGINE_SCRIPT = Path(__file__).with_name("llamacpp_engine.py")


def engine_command(
    engine: str,
    path: Path,
    threads: int,
    args,
    vocab: int,
    int8: bool,
    prefill: list[int],
    steps: int,
    batch: int,
) -> tuple[list[str], dict[str, str]]:
    """benchmarks/llamacpp_engine.py's command line and environment for one engine and thread count: `prefill`
    lengths, `steps` decode steps, a `batch` (k3 with int8 experts, bf16 products, one call where asked)."""
    command = [sys.executable, str(ENGINE_SCRIPT), engine, str(path), "--threads", str(threads)]
    command += ["--prefill", ",".join(map(str, prefill)), "--decode-steps", str(steps)]
    command += ["--decode-context", str(args.decode_context), "--batch", str(batch)]
    command += ["--batch-context", str(args.batch_context), "--weights", args.weights, "--vocab", str(vocab)]
    command += ["--compute", args.k3_compute] + (["--int8-expert-inputs"] if int8 else [])
    command += ["--bf16-products"] if engine == "k3" and args.k3_bf16_products else []
    command += ["--one-call"] if engine == "k3" and args.k3_one_call else []
    env = dict(os.environ)
    if engine != "k3":  # llama.cpp with libgomp's own spin (`import k3` set k3's here: k3/__init__.py)
        env.pop("GOMP_SPINCOUNT", None)
    return command, env


def engine_run(engine: str, path: Path, threads: int, args, vocab: int, int8_experts: bool = False) -> dict:
    """benchmarks/llamacpp_engine.py in a fresh process: one engine, one thread count (k3 with bf16 products
    where --k3-bf16-products says so)."""
    command, env = engine_command(
        engine, path, threads, args, vocab, int8_experts, args.prefill, args.decode_steps, args.batch
    )
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{engine} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(label: str, ours: list[float], theirs: list[float], lower_is_better: bool = False) -> None:
    """One measure: each round's value for both engines and the best against the best (> 1: k3 ahead)."""
    best_k, best_l = (min(ours), min(theirs)) if lower_is_better else (max(ours), max(theirs))
    ratio = best_l / best_k if lower_is_better else best_k / best_l
    cells = [" / ".join(f"{x:,.2f}" for x in values) for values in (ours, theirs)]
    print(f"  {label:>30} {cells[0]:>24} {cells[1]:>24} {ratio:>14.2f}x")


def k3_variants(args) -> list[str]:
    """The k3 engines --k3-experts and --k3-bf16-products ask for, by the names the tables print."""
    variants = {"exact": ["k3"], "int8": ["k3 int8"], "both": ["k3", "k3 int8"]}[args.k3_experts]
    return [f"{name} bf16p" for name in variants] if args.k3_bf16_products else variants


def speed(ckpt: Path, gguf_path: Path, vocab: int, args) -> None:
    """Each engine in its own process, alternated k3, llama.cpp, k3, ... for --repeats rounds per thread
    count (with --k3-experts both: k3 exact, k3 with int8 expert inputs, llama.cpp); the streaming read
    bandwidth, measured before each round and in each engine's process after its timings (the highest of
    them), gives the decode floor (bytes a token reads / bandwidth); the best of the rounds is reported for
    each engine."""
    variants = k3_variants(args)
    print(
        f"\nspeed: one engine per process, alternated, best of {args.repeats} rounds; "
        f"{args.weights} weights; k3 computes in {args.k3_compute}; 'k3 int8': its MXFP4 experts multiply "
        "inputs rounded to int8 per block (k3.ops.mxfp4.int8_x; approximate, as llama.cpp); 'bf16p': its "
        "decode steps multiply BF16 weights by inputs rounded to bf16 (k3.model.tiling; approximate)"
    )
    for n in args.threads:
        torch.set_num_threads(n)
        engines = [(name, ckpt, "int8" in name) for name in variants] + [("llama.cpp", gguf_path, False)]
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in engines}
        bandwidths = []
        for r in range(args.repeats):
            bandwidths.append(read_bandwidth())
            for name, path, int8 in engines:
                runs[name].append(engine_run(name.split()[0], path, n, args, vocab, int8))
                print(f"  [{n} threads, round {r + 1}] {name}: {json.dumps(runs[name][-1])}", flush=True)
            print(f"  [{n} threads, round {r + 1}] {machine_line()}", flush=True)
        print(f"\n  {n} thread(s); read bandwidth before each round {gb(bandwidths)} GB/s; in each engine's")
        in_engines = "; ".join(f"{k} {gb(r['read_bytes_per_s'] for r in v)}" for k, v in runs.items())
        print(f"  process after its timings: {in_engines} GB/s (the floor takes the highest)")
        highest = max([*bandwidths, *(r["read_bytes_per_s"] for v in runs.values() for r in v)])
        for name in variants:
            compare(name, runs[name], runs["llama.cpp"], highest, args)


def engine_server(engine: str, path: Path, threads: int, args, vocab: int, int8: bool):
    """benchmarks/llamacpp_engine.py --serve-steps, loaded and prefilled: the process and its "ready" line
    (room for the untimed step after both engines load and the N timed ones)."""
    command, env = engine_command(engine, path, threads, args, vocab, int8, [], args.alternate_steps + 1, 1)
    command.append("--serve-steps")
    log = tempfile.TemporaryFile(mode="w+")  # llama.cpp's loading messages; shown if it fails
    server = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
    )
    line = server.stdout.readline()
    if not line:
        log.seek(0)
        raise SystemExit(f"{engine} did not load:\n{log.read()[-3000:]}")
    return server, json.loads(line)


def ask(server: subprocess.Popen, what: str) -> float:
    server.stdin.write(what + "\n")
    server.stdin.flush()
    return float(server.stdout.readline())


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo: what new pages can take without swapping out or evicting a mapped file
    that is in use (the kernel's estimate)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no MemAvailable in /proc/meminfo")


def alternate(ckpt: Path, gguf_path: Path, vocab: int, args) -> None:
    """--alternate-steps N: k3 and llama.cpp loaded at once, each in its own process, and N decode steps of
    one sequence after --decode-context tokens taken in turn (k3 then llama.cpp, then the other way round),
    the streaming read measured after each pair (in k3's process, then in llama.cpp's); each k3 variant
    (--k3-experts both: exact, then int8) against llama.cpp loaded afresh. Engines timed minutes apart meet
    different machines where memory bandwidth moves on its own (an EPYC Zen 4 VM, 2026-12-08: a plain read
    34-66 GB/s within a minute, both cores' FMA rate unchanged); steps taken in turn meet the same one.
    Refused where the GGUF does not fit beside the loaded k3: llama.cpp would then be timed reading disk."""
    for n, variant in ((n, variant) for n in args.threads for variant in k3_variants(args)):
        ours, ready = engine_server("k3", ckpt, n, args, vocab, "int8" in variant)
        need, available = gguf_path.stat().st_size + (1 << 30), available_bytes()
        if available < need:
            ours.kill()
            raise SystemExit(
                f"--alternate-steps: {available / 1e9:.1f} GB available with k3 loaded, "
                f"llama.cpp's GGUF needs {need / 1e9:.1f} (with 1 GB to spare); time them one at a time"
            )
        theirs, _ = engine_server("llama.cpp", gguf_path, n, args, vocab, False)
        for server in (ours, theirs):  # untimed: pages the other's loading pushed out come back
            ask(server, "step")
        times: dict[str, list[float]] = {variant: [], "llama.cpp": []}
        reads = []
        for i in range(args.alternate_steps):
            pair = [(variant, ours), ("llama.cpp", theirs)]
            for name, server in pair if i % 2 == 0 else pair[::-1]:
                times[name].append(ask(server, "step"))
            reads.append(ask(ours if i % 2 == 0 else theirs, "read"))
        for server in (ours, theirs):
            server.stdin.close()
            server.wait()
        report_alternated(variant, times, reads, ready["weight_bytes_per_token"], n, args)


def report_alternated(variant: str, times: dict, reads: list, nbytes: float, threads: int, args) -> None:
    k3_ms, ll_ms = (np.array(times[name]) * 1e3 for name in (variant, "llama.cpp"))
    ratios = ll_ms / k3_ms  # > 1: k3 faster, pair by pair
    floor = nbytes / np.array(reads) * 1e3  # each pair's floor, from the read right after it
    print(
        f"\n  {threads} thread(s), {len(k3_ms)} decode steps of each engine after {args.decode_context} "
        f"tokens, taken in turn; read after each pair {min(reads) / 1e9:.1f}-{max(reads) / 1e9:.1f} GB/s"
    )
    for name, ms in ((variant, k3_ms), ("llama.cpp", ll_ms)):
        print(
            f"  {name:>12}: median {np.median(ms):.1f} ms, best {ms.min():.1f}, worst {ms.max():.1f}; "
            f"median {np.median(floor / ms):.0%} of its pair's floor ({nbytes / 1e9:.2f} GB / the read)"
        )
    pairs = " ".join(f"{a:.0f}/{b:.0f}@{r / 1e9:.0f}" for a, b, r in zip(k3_ms, ll_ms, reads, strict=True))
    print(f"  each pair, {variant} / llama.cpp ms @ the read in GB/s: {pairs}")
    print(
        f"  llama.cpp / {variant} pair by pair: median {np.median(ratios):.2f}x "
        f"(range {ratios.min():.2f}-{ratios.max():.2f}x); {variant} faster in {(ratios > 1).sum()} of "
        f"{len(ratios)}; medians {np.median(ll_ms) / np.median(k3_ms):.2f}x, "
        f"best {ll_ms.min() / k3_ms.min():.2f}x"
    )


def gb(rates) -> str:
    return ", ".join(f"{b / 1e9:.1f}" for b in rates)


def compare(name: str, ours: list[dict], theirs: list[dict], bandwidth: float, args) -> None:
    """The table of one k3 variant against llama.cpp, rounds of the same run."""
    ratio = f"{name} / llama.cpp"
    print(f"  {'measure':>30} {name + ' (rounds)':>24} {'llama.cpp (rounds)':>24} {ratio:>15}")
    for T in args.prefill:
        row(
            f"prefill {T} tok/s",
            [T / o["prefill_s"][str(T)] for o in ours],
            [T / t["prefill_s"][str(T)] for t in theirs],
        )
    gemm = max(o["gemm_flops"] for o in ours)
    plans = "; ".join(f"{T}: {' + '.join(map(str, ours[0]['prefill_chunks'][str(T)]))}" for T in args.prefill)
    how = "one call" if args.k3_one_call else "the engine's plan"
    print(f"  {name} prefill chunks ({how}): {plans}")
    for T in args.prefill:
        best = min(ours, key=lambda o, T=T: o["prefill_s"][str(T)])
        flops = 2 * best["macs_per_prefill_token"] * T / best["prefill_s"][str(T)]
        print(
            f"  {name} prefill {T}: {flops / 1e9:.0f} GFLOP/s of weight-matrix products = {flops / gemm:.0%} "
            f"of torch's 2048^3 GEMM in {args.k3_compute}, same processes ({gemm / 1e9:.0f} GFLOP/s)"
        )
    if args.decode_steps:
        ms = [[o["decode_s_per_token"] * 1e3 for o in results] for results in (ours, theirs)]
        row(f"decode ms/token @{args.decode_context}", *ms, lower_is_better=True)
        nbytes = ours[0]["weight_bytes_per_token"]
        floor = nbytes / bandwidth
        best_k = min(o["decode_s_per_token"] for o in ours)
        best_l = min(o["decode_s_per_token"] for o in theirs)
        print(
            f"  decode floor: {nbytes / 1e9:.2f} GB read per token / "
            f"{bandwidth / 1e9:.1f} GB/s = {floor * 1e3:.1f} ms; {name} at {floor / best_k:.0%} of it, "
            f"llama.cpp at {floor / best_l:.0%}"
        )
        # The read moves from minute to minute on a shared machine: each round's step against the read its own
        # process took right after its timings tells the kernels' share from the moment's (the floor above
        # stays the run's highest read, the target's definition).
        shares = [
            " / ".join(f"{nbytes / o['read_bytes_per_s'] / o['decode_s_per_token']:.0%}" for o in r)
            for r in (ours, theirs)
        ]
        print(f"  each round against its own process's read: {name} {shares[0]}, llama.cpp {shares[1]}")
    if args.batch > 1:
        rates = [[args.batch / o["batch_s_per_step"] for o in results] for results in (ours, theirs)]
        row(f"batch {args.batch} decode tok/s", *rates)
        for engine, results in ((name, ours), ("llama.cpp", theirs)):
            one = min(o["decode_s_per_token"] for o in results)
            many = min(o["batch_s_per_step"] for o in results) / args.batch
            print(f"  {engine}: batch of {args.batch} gives {one / many:.2f}x the tokens/s of one sequence")
    print(f"  engines: {name}: {ours[0]['describe']}\n           llama.cpp: {theirs[0]['describe']}\n")


# ---- main -------------------------------------------------------------------------------------------------
def prepare(args, work: Path) -> Path:
    """The checkpoint: --checkpoint, or --preset's random one written in `work` (kept there with --work)."""
    if args.checkpoint:
        return Path(args.checkpoint)
    ckpt = work / args.preset
    if not (ckpt / "config.json").exists():
        cfg = K3Config.preset(args.preset)
        init_checkpoint(cfg, ckpt, seed=args.seed)
        write_tokenizer(ckpt, cfg.vocab_size)
    return ckpt


def gguf(ckpt: Path, path: Path, **options) -> Path:
    """`k3 export gguf` of the checkpoint, unless `path` already holds it (--work keeps them)."""
    if not path.exists():
        report = export_gguf(ckpt, path, **options)
        print(f"exported {report.arch} {options}: {report.nbytes / 1e6:.1f} MB, {report.types}")
    return path


def agreement_report(ckpt: Path, exports: dict[str, Path], args, vocab: int) -> None:
    ids = np.random.default_rng(args.seed + 1).integers(0, vocab, args.tokens).tolist()
    torch.set_num_threads(args.agreement_threads)
    model = K3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = k3_logits(model, ids)
    print(f"\nlogits over {len(ids)} positions (k3 vs llama.cpp; max |logit| {np.abs(ours).max():.2f})")
    print(f"  {'experts':>8} {'KV cache':>9} {'max|d|/max|l|':>14} {'KL':>10} {'top-1':>7}")
    for experts, path in exports.items():
        for cache_name, cache_type in (("F16", GGML_F16), ("F32", GGML_F32)):
            ll = llama(path, len(ids), args.agreement_threads, cache_type)
            a = agreement(ours, llama_logits(ll, ids))
            print(f"  {experts:>8} {cache_name:>9} {a['rel']:>14.2e} {a['kl']:>10.2e} {a['top1']:>7.1%}")
            del ll
    dump = TensorDump(re.compile(r"(attn_norm|kda_out|mla_out|ffn_norm|ffn_out)-\d+|result_norm"))
    ll = llama(exports["f32"], len(ids), args.agreement_threads, GGML_F32, dump)
    dump.tensors.clear()  # keep only the tensors of this evaluation
    llama_logits(ll, ids)
    first_parting(k3_tensors(model, ids), dump.tensors, args.threshold)
    prompt = ids[:16]
    k3_seq = k3_greedy(model, prompt, args.greedy)
    print(f"\ngreedy continuation of {args.greedy} tokens after a 16-token prompt:")
    for experts, path in exports.items():
        ll = llama(path, 16 + args.greedy + 1, args.agreement_threads, GGML_F16)
        ll_seq = llama_greedy(ll, prompt, args.greedy)
        same = next((i for i, (a, b) in enumerate(zip(k3_seq, ll_seq, strict=True)) if a != b), len(k3_seq))
        print(f"  {experts} experts: identical for the first {same} of {args.greedy} tokens")


def numbers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a k3 checkpoint directory (with tokenizer); default: --preset")
    ap.add_argument("--preset", default="mini", help="random checkpoint to write when --checkpoint is absent")
    ap.add_argument("--work", type=Path, help="keep the checkpoint and GGUFs here (reused when present)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threshold", type=float, default=1e-3)
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--agreement-threads", type=int, default=2)
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--threads", type=numbers, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2, help="--speed: rounds (k3, llama.cpp) per thread count")
    ap.add_argument("--prefill", type=numbers, default=[512, 2048], help="--speed: prefill lengths")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--decode-context", type=int, default=512, help="--speed: tokens before the decode steps")
    ap.add_argument("--batch", type=int, default=8, help="--speed: sequences decoded together (1: none)")
    ap.add_argument("--batch-context", type=int, default=64, help="--speed: tokens of each batched sequence")
    ap.add_argument(
        "--weights", choices=("f32", "bf16"), default="f32", help="--speed: both engines' weight matrices"
    )
    ap.add_argument(
        "--k3-compute",
        choices=("fp32", "bf16"),
        default="fp32",
        help="--speed: k3's activations (bf16: bf16 matmuls; decode then takes the general path)",
    )
    ap.add_argument(
        "--k3-experts",
        choices=("exact", "int8", "both"),
        default="exact",
        help="--speed: k3's MXFP4 experts exact, with inputs rounded to int8 per block, or both (3 engines)",
    )
    ap.add_argument(
        "--k3-bf16-products",
        action="store_true",
        help="--speed: k3 decodes with bf16 products (BF16 weights paired: k3 generate --bf16-products)",
    )
    ap.add_argument(
        "--k3-one-call",
        action="store_true",
        help="--speed: k3 prefills a prompt in one model call (default: in its engine's chunks)",
    )
    ap.add_argument(
        "--alternate-steps",
        type=int,
        default=0,
        help="both engines loaded at once, this many decode steps of each taken in turn (alternate)",
    )
    args = ap.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ckpt = prepare(args, work)
        cfg = K3Config.from_pretrained(ckpt)
        vocab = cfg.vocab_size - 256  # ids drawn below the special tokens
        if not args.skip_agreement:
            exports = {"f32": gguf(ckpt, work / "f32.gguf", experts="f32")}
            if cfg.experts_mxfp4:
                exports["mxfp4"] = gguf(ckpt, work / "mxfp4.gguf", experts="mxfp4")
            agreement_report(ckpt, exports, args, vocab)
        if args.speed or args.alternate_steps:
            experts = "mxfp4" if cfg.experts_mxfp4 else "f32"
            outtype = {"bf16": "bf16", "f32": "f32"}[args.weights]  # bf16: the published dtype of non-experts
            path = gguf(ckpt, work / f"speed-{outtype}-{experts}.gguf", outtype=outtype, experts=experts)
            if args.speed:
                speed(ckpt, path, vocab, args)
            if args.alternate_steps:
                alternate(ckpt, path, vocab, args)
        print(machine_line())


if __name__ == "__main__":
    main()
