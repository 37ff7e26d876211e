"""One engine's speed in its own process, for benchmarks/llamacpp.py --speed: k3 on a checkpoint or llama.cpp
(through llama-cpp-python's C API) on a GGUF. Prints one JSON line of seconds.

    .venv/bin/python benchmarks/llamacpp_engine.py {k3,llama.cpp} PATH --threads 2 [--prefill 512,2048]
        [--decode-steps 16] [--batch 8 --batch-context 64] [--weights bf16] [--vocab V]

    .venv/bin/python benchmarks/llamacpp_engine.py {k3,llama.cpp} PATH --serve-steps --decode-steps N ...
        # decode steps one at a time, on request (benchmarks/llamacpp.py --alternate-steps)

One process per engine and setting: at k3-slice's size (11 GB of weights per engine) two engines in one
process would evict each other's pages from a 24 GB page cache, and the second would be timed reading disk.

Both engines do the same work, as a server does it:
* prefill of T token ids (random, from a fixed seed), the logits of the last position only: k3 in the chunks
  its engine takes (`Engine.chunk_size`: at k3-slice's 96 MLA heads a 2,048-token prompt goes in seven of
  ~293), or in one call with `--one-call`; llama.cpp in one batch of T;
* then decode steps of one token after those T tokens (the first two untimed);
* a batch: `--batch` sequences, each prefilled with `--batch-context` different ids, then steps of one token
  for every sequence at once (one forward of [batch, 1]; one llama_batch of `batch` tokens).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

WARMUP_STEPS = 2
# Tokens of an untimed prefill before the timed ones: every weight is touched once (read from disk if the
# other engine's run pushed it out of the page cache; llama.cpp reads all of them at load, k3 maps them),
# and both engines' GEMM set-up is done.
WARMUP_PREFILL = 32


def prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(count)]


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- k3 ---------------------------------------------------------------------------------------------------
class K3Engine:
    def __init__(
        self,
        path: Path,
        threads: int,
        weights: str,
        compute: str,
        int8_experts: bool,
        bf16_products: bool,
        one_call: bool,
    ) -> None:
        import k3  # noqa: F401, I001 (first: the environment it sets for torch's libraries, k3/__init__.py)
        import torch

        from k3.engine.generate import Engine
        from k3.model import K3ForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        dtype = torch.bfloat16 if weights == "bf16" else torch.float32
        compute_dtype = torch.bfloat16 if compute == "bf16" else torch.float32
        self.model = K3ForCausalLM.from_pretrained(path, dtype=dtype, compute_dtype=compute_dtype).eval()
        self.model.tile_weights(bf16_products)  # as `k3 generate` loads it (k3.model.tiling)
        self.chunking = None if one_call else Engine(self.model)  # its chunk plan: a prompt's prefill's
        self.model.set_int8_expert_inputs(int8_experts)  # `k3 generate --int8-expert-inputs`
        self.model.set_native_activations(True)  # as `k3 generate` loads it

    def weight_bytes(self) -> float:
        """Bytes of weights one decode token reads: all but the embedding table (one row of it is read), the
        routed experts in proportion (k of E per layer: all of them in k3-slice, where k = E)."""
        from k3.model.moe import RoutedExpert

        cfg = self.model.config
        share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
        experts = [m for m in self.model.modules() if isinstance(m, RoutedExpert)]
        routed = {id(t) for m in experts for t in (*m.parameters(), *m.buffers())}
        skip = {id(self.model.model.embed_tokens.weight)}
        tensors = {id(t): t for t in (*self.model.parameters(), *self.model.buffers()) if id(t) not in skip}
        return sum(t.nbytes * (share if key in routed else 1.0) for key, t in tensors.items())

    def macs_per_prefill_token(self) -> float:
        """Multiply-adds of the weight matrices one prefill token runs through: every 2-D weight and MXFP4
        matrix but the embedding table and lm_head (a prefill keeps one position's logits), the routed
        experts in proportion k / E; attention's own products (a few % at these lengths) not counted."""
        from k3.model.moe import RoutedExpert
        from k3.model.norm import Linear
        from k3.ops.mxfp4 import MXFP4Linear

        cfg = self.model.config
        share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 1.0
        routed = {id(m) for e in self.model.modules() if isinstance(e, RoutedExpert) for m in e.modules()}
        skip = {id(self.model.model.embed_tokens), id(self.model.lm_head)}
        total = 0.0
        for m in self.model.modules():
            if id(m) in skip:
                continue
            if isinstance(m, MXFP4Linear | Linear):  # a Linear's weight in rows or tiled (k3.model.tiling)
                macs = m.in_features * m.out_features
            elif isinstance(getattr(m, "weight", None), self.torch.Tensor) and m.weight.dim() == 2:
                macs = m.weight.numel()
            else:
                continue
            total += macs * (share if id(m) in routed else 1.0)
        return total

    def gemm_flops(self) -> float:
        """FLOP/s of torch's 2048^3 GEMM in the dtype k3 computes in (best of 3), this process's threads."""
        a = self.torch.randn(2048, 2048, dtype=self.torch.float32).to(self.model.compute_dtype)
        b = self.torch.randn(2048, 2048, dtype=self.torch.float32).to(self.model.compute_dtype)
        a @ b
        return 2 * 2048**3 / min(seconds(lambda: a @ b) for _ in range(3))

    def chunks(self, tokens: int) -> list[int]:
        """The chunk sizes one prompt of `tokens` is prefilled in."""
        sizes: list[int] = []
        while sum(sizes) < tokens:
            done = sum(sizes)
            left = tokens - done
            sizes.append(left if self.chunking is None else self.chunking.chunk_size(done, left))
        return sizes

    def prefill(self, batch: list[list[int]]):
        """One prompt in its chunks (`chunks`); a batch of prompts (untimed set-up) in one call."""
        cache = self.model.new_cache(len(batch))
        ids = self.torch.tensor(batch)
        sizes = self.chunks(ids.shape[1]) if len(batch) == 1 else [ids.shape[1]]
        with self.torch.no_grad():
            done = 0
            for size in sizes:
                self.model(ids[:, done : done + size], cache, logits_to_keep=1)
                done += size
        return cache

    def step(self, cache, count: int) -> None:
        with self.torch.no_grad():
            self.model(self.torch.ones(count, 1, dtype=self.torch.long), cache)

    def describe(self) -> str:
        from k3.model.tiling import is_paired
        from k3.ops.doctor import kernel_reports

        kernels = [f"{k['name']} {k['in_use']} {k['variant'] or ''}".strip() for k in kernel_reports()]
        int8 = any(getattr(m, "int8_inputs", False) for m in self.model.modules())
        experts = "int8 inputs" if int8 else "exact"
        paired = any(is_paired(p) for p in self.model.parameters())
        products = "bf16 products (paired)" if paired else "exact (tiled)"
        return f"k3 kernels: {', '.join(kernels)}; MXFP4 experts {experts}; BF16 weights {products}"


# ---- llama.cpp --------------------------------------------------------------------------------------------
class LlamaEngine:
    """llama.cpp's C API: a context with `sequences` sequence slots, default settings otherwise (F16 KV
    cache, its default flash-attention choice), one llama_batch per call, logits of each sequence's last
    token."""

    def __init__(self, path: Path, threads: int, n_ctx: int, sequences: int, n_batch: int) -> None:
        import llama_cpp as C

        self.C = C
        C.llama_backend_init()
        self.llama_model = C.llama_model_load_from_file(str(path).encode(), C.llama_model_default_params())
        if not self.llama_model:
            raise SystemExit(f"llama.cpp could not load {path}")
        params = C.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.n_threads, params.n_threads_batch = sequences, threads, threads
        params.kv_unified = True  # every sequence may use the whole context (the default splits it n ways)
        self.ctx = C.llama_init_from_model(self.llama_model, params)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create a context")
        self.batch = C.llama_batch_init(n_batch, 0, sequences)
        self.positions: list[int] = []

    def _decode(self, rows: list[list[int]]) -> None:
        """Row s's tokens continue sequence s."""
        C, b, n = self.C, self.batch, 0
        for s, tokens in enumerate(rows):
            for i, token in enumerate(tokens):
                b.token[n], b.pos[n], b.n_seq_id[n] = token, self.positions[s] + i, 1
                b.seq_id[n][0], b.logits[n] = s, int(i == len(tokens) - 1)
                n += 1
            self.positions[s] += len(tokens)
        b.n_tokens = n
        if C.llama_decode(self.ctx, b) != 0:
            raise SystemExit("llama_decode failed")
        C.llama_synchronize(self.ctx)

    def prefill(self, batch: list[list[int]]):
        self.C.llama_memory_clear(self.C.llama_get_memory(self.ctx), True)
        self.positions = [0] * len(batch)
        self._decode(batch)
        return None

    def step(self, cache, count: int) -> None:
        self._decode([[1]] * count)

    def describe(self) -> str:
        import llama_cpp

        flags = self.C.llama_print_system_info().decode().strip()
        return f"llama-cpp-python {llama_cpp.__version__}, {ggml_build()}; {flags}"


def ggml_build() -> str:
    """The loaded llama.cpp's ggml as it reports itself (`ggml_version`; `ggml_commit`: the llama.cpp commit
    it was built from, "-dirty" for a tree with local changes), or what is missing."""
    from llama_cpp.llama_cpp import _lib  # the libllama in use (LLAMA_CPP_LIB_PATH's or the wheel's)

    try:
        version, commit = _lib.ggml_version, _lib.ggml_commit  # dlsym searches libllama's dependencies too
    except AttributeError:
        return "ggml's version and commit not exported by this build"
    version.restype = commit.restype = ctypes.c_char_p
    return f"ggml {version().decode()}, llama.cpp commit {commit().decode()}"


# ---- the measurements -------------------------------------------------------------------------------------
def measure(engine, args) -> dict:
    out: dict = {"engine": args.engine, "threads": args.threads, "describe": engine.describe()}
    out["prefill_s"] = {}
    if isinstance(engine, K3Engine):
        out["weight_bytes_per_token"] = engine.weight_bytes()
        out["macs_per_prefill_token"] = engine.macs_per_prefill_token()
        out["gemm_flops"] = engine.gemm_flops()
        out["prefill_chunks"] = {T: engine.chunks(T) for T in args.prefill}
    engine.prefill(prompts(args.vocab, 1, WARMUP_PREFILL, seed=WARMUP_PREFILL))
    for T in args.prefill:
        ids = prompts(args.vocab, 1, T, seed=T)
        out["prefill_s"][T] = seconds(lambda ids=ids: engine.prefill(ids))
    if args.decode_steps:
        cache = engine.prefill(prompts(args.vocab, 1, args.decode_context, seed=args.decode_context))
        for _ in range(WARMUP_STEPS):
            engine.step(cache, 1)
        out["decode_s_per_token"] = (
            seconds(lambda: [engine.step(cache, 1) for _ in range(args.decode_steps)]) / args.decode_steps
        )
    if args.batch > 1:
        batch = prompts(args.vocab, args.batch, args.batch_context, seed=1000 + args.batch_context)
        cache = engine.prefill(batch)
        for _ in range(WARMUP_STEPS):
            engine.step(cache, args.batch)
        out["batch"] = args.batch
        out["batch_s_per_step"] = (
            seconds(lambda: [engine.step(cache, args.batch) for _ in range(args.decode_steps)])
            / args.decode_steps
        )
    out["read_bytes_per_s"] = read_here(args.threads)
    return out


def serve_steps(engine, args) -> None:
    """--serve-steps: prefill --decode-context ids, take the untimed steps, print "ready", then answer each
    line read from stdin: "step" with one decode step's seconds, "read" with the streaming read bandwidth
    (bytes/s) measured here; anything else ends the process. benchmarks/llamacpp.py --alternate-steps keeps
    two such processes loaded and asks them for steps in turn."""
    cache = engine.prefill(prompts(args.vocab, 1, args.decode_context, seed=args.decode_context))
    for _ in range(WARMUP_STEPS):
        engine.step(cache, 1)
    ready = {"ready": engine.describe()}
    if isinstance(engine, K3Engine):
        ready["weight_bytes_per_token"] = engine.weight_bytes()
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() == "step":
            print(seconds(lambda: engine.step(cache, 1)), flush=True)
        elif line.strip() == "read":
            print(read_here(args.threads), flush=True)
        else:
            return


def read_here(threads: int) -> float:
    """The streaming read bandwidth (k3.ops.roofline) measured in this engine's process after its timings, at
    its threads: the memory as this process has it. On a VM the figure moves with the process (EPYC Zen 4,
    2026-12-04: 33-39 GB/s in a fresh process, 30-34 with k3-slice just loaded, 62-66 once its weights were
    tiled and the loading copies freed), so the floor takes the highest of the run."""
    import torch

    from k3.ops.roofline import read_bandwidth

    torch.set_num_threads(threads)
    return read_bandwidth()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=("k3", "llama.cpp"))
    ap.add_argument("path", type=Path, help="k3: a checkpoint directory; llama.cpp: a GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",") if x], default=[512, 2048])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--batch-context", type=int, default=64)
    ap.add_argument("--weights", choices=("f32", "bf16"), default="f32", help="k3: dtype of weight matrices")
    ap.add_argument("--compute", choices=("fp32", "bf16"), default="fp32", help="k3: dtype of activations")
    ap.add_argument(
        "--int8-expert-inputs", action="store_true", help="k3: MXFP4 experts multiply inputs rounded to int8"
    )
    ap.add_argument("--bf16-products", action="store_true", help="k3: BF16 weights paired for bf16 products")
    ap.add_argument("--one-call", action="store_true", help="k3: a prompt in one call, not in chunks")
    ap.add_argument("--vocab", type=int, required=True, help="ids are drawn from [0, vocab)")
    ap.add_argument(
        "--serve-steps", action="store_true", help="decode steps one at a time on request (serve_steps)"
    )
    args = ap.parse_args()
    longest = max([*args.prefill, args.decode_context, args.batch_context])
    if args.engine == "k3":
        engine = K3Engine(
            args.path,
            args.threads,
            args.weights,
            args.compute,
            args.int8_expert_inputs,
            args.bf16_products,
            args.one_call,
        )
    else:
        n_ctx = args.batch * (args.batch_context + args.decode_steps + WARMUP_STEPS) + longest
        n_ctx = max(n_ctx, longest + args.decode_steps + WARMUP_STEPS) + 16
        n_batch = max(longest, args.batch * args.batch_context)
        engine = LlamaEngine(args.path, args.threads, n_ctx, max(args.batch, 1), n_batch)
    if args.serve_steps:
        serve_steps(engine, args)
    else:
        print(json.dumps(measure(engine, args)), flush=True)


if __name__ == "__main__":
    main()
