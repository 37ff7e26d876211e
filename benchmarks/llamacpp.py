"""k3 and llama.cpp on the same checkpoint and the same token ids: agreement, per-tensor comparison, greedy
continuations, and speed, the engines alternated in one run.

    .venv/bin/python benchmarks/llamacpp.py [--checkpoint DIR | --preset mini] [--tokens 512]
        [--threshold 1e-3] [--greedy 32] [--speed] [--threads 1,2] [--skip-agreement]

Needs `llama-cpp-python` (the `llamacpp` extra, never in CI): `pip install llama-cpp-python==0.3.36`
(it compiles llama.cpp: ~15 minutes on 2 cores; that version's llama.cpp has kimi-linear and kimi-k3).
The checkpoint is exported with `k3 export gguf` twice, experts MXFP4 and experts exactly decoded (F32);
weights F32 in both.

1. Logits agreement over --tokens random ids (the same ids into both engines): max |dlogit| / max |logit|,
   mean KL(k3 || llama.cpp) per position, top-1 agreement; for MXFP4 and F32 experts, with llama.cpp's
   default F16 KV cache and with an F32 one.
2. Per-tensor comparison (F32 cache, F32 experts): every layer's norms, mixer output and FFN output from
   llama.cpp's scheduler eval callback (`cb_eval`, through ctypes) against k3's through forward hooks; the
   first tensor whose max |d| / max |value| exceeds --threshold is printed.
3. Greedy continuations of --greedy tokens after a 16-token prompt, each engine with its own cache.
4. --speed: prefill tokens/s at 512 and 2,048 tokens and decode ms/token after a 512-token prefill, at each
   of --threads, k3 and llama.cpp (MXFP4 experts, its default cache) alternated, best of --repeats;
   `--weights bf16`: every other weight matrix BF16 in both (k3 computes in fp32 on them; GGUF `bf16`).
The CPU's model and SIMD flags and the load average are printed: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from k3.config import K3Config
from k3.export.gguf import export_gguf
from k3.model import K3ForCausalLM
from k3.model.init import init_checkpoint
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
def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def speed(
    ckpt: Path,
    gguf_path: Path,
    vocab: int,
    threads: list[int],
    repeats: int,
    decode_steps: int,
    weights: torch.dtype = torch.float32,
) -> None:
    """`weights`: both engines' weight matrices (experts MXFP4 in both); k3 computes in fp32."""
    rng = np.random.default_rng(7)
    print(f"\nspeed (best of {repeats}; engines alternated per setting; weights {weights})")
    print(f"  {'threads':>7} {'measure':>24} {'k3':>12} {'llama.cpp':>12}")
    model = K3ForCausalLM.from_pretrained(ckpt, dtype=weights, compute_dtype=torch.float32).eval()
    for n in threads:
        torch.set_num_threads(n)
        ll = llama(gguf_path, 2048 + decode_steps + 8, n, GGML_F16)
        for T in (512, 2048):
            ids = rng.integers(0, vocab, T).tolist()
            k3_t, ll_t = float("inf"), float("inf")
            for _ in range(repeats):  # alternate: k3, llama.cpp, k3, llama.cpp, ...
                k3_t = min(k3_t, timed(lambda ids=ids: k3_logits(model, ids), 1))
                ll_t = min(ll_t, timed(lambda ids=ids, ll=ll: llama_logits(ll, ids), 1))
            print(f"  {n:>7} {f'prefill {T} tok/s':>24} {T / k3_t:>12,.0f} {T / ll_t:>12,.0f}")
        prompt = rng.integers(0, vocab, 512).tolist()
        k3_d, ll_d = float("inf"), float("inf")
        for _ in range(repeats):
            cache = model.new_cache(1)
            with torch.no_grad():
                model(torch.tensor([prompt]), cache)
                t0 = time.perf_counter()
                for _ in range(decode_steps):
                    model(torch.tensor([[1]]), cache)
            k3_d = min(k3_d, (time.perf_counter() - t0) / decode_steps)
            ll.reset()
            ll.eval(prompt)
            t0 = time.perf_counter()
            for _ in range(decode_steps):
                ll.eval([1])
            ll_d = min(ll_d, (time.perf_counter() - t0) / decode_steps)
        print(f"  {n:>7} {'decode ms/token @512':>24} {k3_d * 1e3:>12.2f} {ll_d * 1e3:>12.2f}")


def cpu_line() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.+)", info)
    flags = set(re.search(r"flags\s*:\s*(.+)", info).group(1).split()) if "flags" in info else set()
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    return (
        f"CPU: {model.group(1) if model else 'unknown'}, {os.cpu_count()} cores; flags {' '.join(simd)}; "
        f"load average {load[0]:.2f}"
    )


# ---- main -------------------------------------------------------------------------------------------------
def prepare(args, work: Path) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    ckpt = work / args.preset
    cfg = K3Config.preset(args.preset)
    init_checkpoint(cfg, ckpt, seed=args.seed)
    write_tokenizer(ckpt, cfg.vocab_size)
    return ckpt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a k3 checkpoint directory (with tokenizer); default: --preset")
    ap.add_argument("--preset", default="mini", help="random checkpoint to write when --checkpoint is absent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threshold", type=float, default=1e-3)
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--agreement-threads", type=int, default=2)
    ap.add_argument(
        "--weights", choices=("f32", "bf16"), default="f32", help="--speed: both engines' weight matrices"
    )
    args = ap.parse_args()
    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = prepare(args, work)
        cfg = K3Config.from_pretrained(ckpt)
        exports = {}
        for experts in ("mxfp4", "f32"):
            exports[experts] = work / f"{experts}.gguf"
            report = export_gguf(ckpt, exports[experts], experts=experts)
            print(f"exported {report.arch} ({experts} experts): {report.nbytes / 1e6:.1f} MB, {report.types}")
        if not cfg.experts_mxfp4:
            exports.pop("mxfp4")
        ids = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size - 256, args.tokens).tolist()
        if not args.skip_agreement:
            torch.set_num_threads(args.agreement_threads)
            model = K3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
            ours = k3_logits(model, ids)
            print(
                f"\nlogits over {len(ids)} positions (k3 vs llama.cpp; max |logit| {np.abs(ours).max():.2f})"
            )
            print(f"  {'experts':>8} {'KV cache':>9} {'max|d|/max|l|':>14} {'KL':>10} {'top-1':>7}")
            for experts, path in exports.items():
                for cache_name, cache_type in (("F16", GGML_F16), ("F32", GGML_F32)):
                    ll = llama(path, len(ids), args.agreement_threads, cache_type)
                    a = agreement(ours, llama_logits(ll, ids))
                    print(
                        f"  {experts:>8} {cache_name:>9} {a['rel']:>14.2e} {a['kl']:>10.2e} {a['top1']:>7.1%}"
                    )
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
                same = next(
                    (i for i, (a, b) in enumerate(zip(k3_seq, ll_seq, strict=True)) if a != b), len(k3_seq)
                )
                print(f"  {experts} experts: identical for the first {same} of {args.greedy} tokens")
        if args.speed:
            threads = [int(x) for x in args.threads.split(",")]
            gguf = exports.get("mxfp4", exports["f32"])
            if args.weights == "bf16":  # the published checkpoint's dtype for every non-expert matrix
                gguf = work / "bf16.gguf"
                export_gguf(ckpt, gguf, outtype="bf16", experts="mxfp4" if cfg.experts_mxfp4 else None)
            dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
            speed(ckpt, gguf, cfg.vocab_size - 256, threads, args.repeats, args.decode_steps, dtype)
        print(cpu_line())


if __name__ == "__main__":
    main()
