"""Decode cost and cache size against context length: hybrid `mini` (KDA + MLA) vs the same model with every
layer MLA, in one run; and server throughput with 1 vs N concurrent streams.

    .venv/bin/python benchmarks/decode.py                          # contexts 1k, 8k, 32k, 64k
    .venv/bin/python benchmarks/decode.py --contexts 1024,8192 --steps 8
    .venv/bin/python benchmarks/decode.py --skip-decode --server   # server throughput only

Random weights (`K3ForCausalLM.from_config`, seed 0). One sequence is prefilled with random tokens in
chunks (the engine's chunk policy) up to each context, then `--steps` decode steps are timed; the time
spent inside KDA and MLA mixers is measured with forward hooks. The decode steps add `--steps` tokens to
the context before the next prefill (negligible). Targets (issue 7): the KDA part of decode flat (<= 5 %
growth 1k -> 64k) and the hybrid cache <= 30 % of the all-MLA cache at 64k. Timings on a shared machine
are noisy; `--threads 1` (default) avoids torch's thread spinning when other processes hold the cores.

    .venv/bin/python benchmarks/decode.py --step-profile --threads 2   # the decode step, fused vs general
    .venv/bin/python benchmarks/decode.py --step-profile --checkpoint CKPT   # the same on a checkpoint
    .venv/bin/python benchmarks/decode.py --batch 1,4,8 [--checkpoint CKPT]  # batched decode tokens/s
    .venv/bin/python benchmarks/decode.py --batch 1,8 --checkpoint CKPT --bf16-products  # bf16 products

A preset's random models are laid out as `k3 generate` loads a checkpoint (`as_loaded`) for `--step-profile`
and `--batch`.

`--step-profile`: ms/token of one decode step and the aten ops it dispatches (top-level ops, torch
profiler), by component (MoE, KDA, MLA, dense MLP, the rest: norms, AttnRes, embeddings, lm_head), for each
decode path (`decode_paths`: the step's layers in one native call, only its total timed; the fused kernels
layer by layer, each component timed; the general path, `K3ForCausalLM.set_fast_decode(False)`), the paths
taking turns in blocks of 10 steps in one process so that all see the same machine load (each block's first
step, which builds the decode plan again, not counted); experts MXFP4 and F32 (and MXFP4 with inputs rounded
to int8, `--int8-expert-inputs`: k3.ops.mxfp4.int8_x). The fused path is k3.model.fused: its component
times are those of its functions, `fused calls` how many of them ran in the profiled step (0 on the general
path). Then, for the fused path, the bytes of weights a token reads by component (`component_bytes`) and the
GB/s each part runs at, beside a read of a 512 MiB buffer in the same run: the floor the step could reach,
with each path's share of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from server_streams import server_throughput  # benchmarks/ is on the path as a script

from k3.config import K3Config, Mixer
from k3.engine.generate import Engine
from k3.engine.sequence_cache import cache_bytes_formula, row_cache_bytes
from k3.model import K3ForCausalLM
from k3.model import fused as fused_step
from k3.model.kda import KDAttention
from k3.model.mla import MLAttention
from k3.ops.roofline import machine_line, read_bandwidth


class MixerClock:
    """Accumulates wall time spent in KDA and MLA mixers: forward pre/post hooks for the general path, and
    k3.model.fused's `kda_update` / `mla_update` wrapped for the fused decode step, which calls no module
    forward (a fused call that returns None hands the layer to the general path, whose hooks time it); the
    step's layers run one by one meanwhile (not in one native call), so that each mixer is seen.
    `close()` puts the fused functions and the route back as they were."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._one_call = getattr(model.model, "one_call_decode", None)  # None: a tree without that route
        if self._one_call is not None:
            model.model.one_call_decode = False
        self.seconds = {"kda": 0.0, "mla": 0.0}
        self._start: dict[int, float] = {}
        self._hooks = []
        for module in model.modules():
            if isinstance(module, KDAttention | MLAttention):
                kind = "kda" if isinstance(module, KDAttention) else "mla"
                self._hooks.append(module.register_forward_pre_hook(self._pre))
                post = module.register_forward_hook(lambda m, i, o, kind=kind: self._post(m, kind))
                self._hooks.append(post)
        self._originals = {name: getattr(fused_step, name) for name in ("kda_update", "mla_update")}
        for name, function in self._originals.items():
            setattr(fused_step, name, self._timed(function, name.split("_")[0]))

    def _timed(self, function, kind: str):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = function(*args, **kwargs)
            if out is not None:
                self.seconds[kind] += time.perf_counter() - t
            return out

        return timed

    def _pre(self, module: torch.nn.Module, _: object) -> None:
        self._start[id(module)] = time.perf_counter()

    def _post(self, module: torch.nn.Module, kind: str) -> None:
        self.seconds[kind] += time.perf_counter() - self._start.pop(id(module))

    def reset(self) -> None:
        self.seconds = {"kda": 0.0, "mla": 0.0}

    def close(self) -> None:
        if self._one_call is not None:
            self._model.model.one_call_decode = self._one_call
        for name, function in self._originals.items():
            setattr(fused_step, name, function)
        for hook in self._hooks:
            hook.remove()


def all_mla(cfg: K3Config) -> K3Config:
    return dataclasses.replace(cfg, kda_layers=[], mla_layers=list(range(cfg.num_hidden_layers)))


@torch.no_grad()
def decode_curve(cfg: K3Config, contexts: list[int], steps: int, label: str) -> list[dict]:
    t0 = time.perf_counter()
    model = K3ForCausalLM.from_config(cfg, seed=0)
    engine = Engine(model)  # only for its prefill chunk policy
    clock = MixerClock(model)
    cache = model.new_cache(1)
    gen = torch.Generator().manual_seed(0)
    rows, done, prefill_s = [], 0, 0.0
    print(f"[{label}] model built in {time.perf_counter() - t0:.1f} s", flush=True)
    for ctx in contexts:
        t = time.perf_counter()
        while done < ctx:
            size = engine.chunk_size(done, ctx - done)
            model(torch.randint(0, cfg.vocab_size, (1, size), generator=gen), cache, logits_to_keep=1)
            done += size
        prefill_s += time.perf_counter() - t
        token = torch.tensor([[1]])
        model(token, cache)  # warm-up step
        done += 1
        clock.reset()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            logits = model(token, cache)
            times.append(time.perf_counter() - t)
            token = logits[:, -1].argmax(-1, keepdim=True)
            done += 1
        measured = row_cache_bytes(cache, 0)
        formula = cache_bytes_formula(cfg, done)
        row = {
            "model": label,
            "context": ctx,
            "ms_per_token": 1e3 * statistics.median(times),
            "kda_ms": 1e3 * clock.seconds["kda"] / steps,
            "mla_ms": 1e3 * clock.seconds["mla"] / steps,
            "cache_bytes": measured["total"],
            "cache_kda_bytes": measured["kda"],
            "cache_mla_bytes": measured["mla"],
            "cache_matches_formula": measured == formula,
            "prefill_s_so_far": prefill_s,
        }
        rows.append(row)
        print(
            f"[{label}] ctx {ctx:>6}: {row['ms_per_token']:7.2f} ms/token (KDA {row['kda_ms']:6.2f}, "
            f"MLA {row['mla_ms']:6.2f}), cache {measured['total'] / 2**20:8.2f} MiB "
            f"(formula {'ok' if row['cache_matches_formula'] else 'MISMATCH'}), "
            f"prefill so far {prefill_s:.0f} s",
            flush=True,
        )
    clock.close()
    return rows


# ---- one decode step, fused vs general -----------------------------------------------------------------
COMPONENTS = (("moe", "MoE"), ("kda", "KDAttention"), ("mla", "MLAttention"), ("mlp", "MLP"))


def label_components(model: K3ForCausalLM) -> None:
    """Wrap each component's forward in a profiler range named after it (shared experts count as MoE)."""
    from torch.profiler import record_function

    inside_moe = {id(m) for moe in model.modules() if type(moe).__name__ == "MoE" for m in moe.modules()}
    for module in model.modules():
        kind = next((k for k, name in COMPONENTS if type(module).__name__ == name), None)
        if kind is None or (kind == "mlp" and id(module) in inside_moe):
            continue
        forward = module.forward

        def labelled(*args, _forward=forward, _kind=kind, **kwargs):
            with record_function(f"component:{_kind}"):
                return _forward(*args, **kwargs)

        module.forward = labelled


FUSED = (("moe", "moe_update"), ("kda", "kda_update"), ("mla", "mla_update"), ("mlp", "mlp_update"))


def tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def by_component(
    model: K3ForCausalLM, measure: Callable[[torch.nn.Module], int]
) -> tuple[dict[str, int], int]:
    """`measure` of the modules one sequence's decode step runs, by component: every KDA / MLA mixer and dense
    MLP whole; per MoE layer its router, latent projections and shared experts plus top_k routed experts; and
    the measure of the routed experts a step does not run. `rest` is left at 0 for the caller."""
    out = dict.fromkeys([k for k, _ in COMPONENTS] + ["rest"], 0)
    not_run = 0
    for layer in model.model.layers:
        out["kda" if isinstance(layer.self_attn, KDAttention) else "mla"] += measure(layer.self_attn)
        if not layer.is_moe:
            out["mlp"] += measure(layer.mlp)
            continue
        moe = layer.block_sparse_moe
        idle = (len(moe.experts) - moe.gate.top_k) * measure(moe.experts[0])
        out["moe"] += measure(moe) - idle
        not_run += idle
    return out, not_run


def component_bytes(model: K3ForCausalLM) -> dict[str, int]:
    """Bytes of weights one sequence's decode step reads, by component (`by_component`); the rest: lm_head,
    norms and AttnRes vectors (the embedding row is negligible)."""
    out, unread = by_component(model, tensor_bytes)
    # the embedding table is read a row a token; tied, it is lm_head's weight (counted once), read whole
    unread += 0 if model.config.tie_word_embeddings else tensor_bytes(model.model.embed_tokens)
    out["rest"] = tensor_bytes(model) - unread - sum(out.values())
    return out


def print_bandwidth(rows: list[dict], read_bytes_per_s: float) -> None:
    """The fused path's GB/s per component against the read bandwidth measured in this run, and where the
    one-call step (the default, whose components are not seen) stands against the same floor."""
    one_call = {r["experts"]: r["ms_per_token"] for r in rows if r["path"] == "one call"}
    for r in rows:
        if r["path"] != "fused":
            continue
        parts = r["component_bytes"]
        ms = dict(r["component_ms"], rest=r["ms_per_token"] - sum(r["component_ms"].values()))
        total = sum(parts.values())
        floor_ms = 1e3 * total / read_bytes_per_s
        steps = [("the step", r["ms_per_token"])]
        if r["experts"] in one_call:
            steps = [("layer by layer", r["ms_per_token"]), ("in one call", one_call[r["experts"]])]
        print(
            f"{r['experts']:>7} fused: weights read per token "
            + ", ".join(
                f"{k} {parts[k] / 1e6:.1f} MB at {parts[k] / ms[k] / 1e6:.1f} GB/s" for k in parts if parts[k]
            )
            + f"; {total / 1e9:.3f} GB / {read_bytes_per_s / 1e9:.1f} GB/s read = floor {floor_ms:.2f} ms, "
            + ", ".join(f"{name} at {100 * floor_ms / step_ms:.0f} % of it" for name, step_ms in steps)
        )


def wrap_fused(clock: ComponentClock) -> None:
    """Label and time k3.model.fused's per-component functions (the fused step calls no module forward),
    and count their native calls; nothing in a tree that has no k3.model.fused."""
    try:
        from k3.model import fused
    except ImportError:
        return
    from torch.profiler import record_function

    for kind, name in FUSED:
        function = getattr(fused, name)

        def wrapped(*args, _function=function, _kind=kind, **kwargs):
            with record_function(f"component:{_kind}"):
                t = time.perf_counter()
                out = _function(*args, **kwargs)
                clock.seconds[_kind] += time.perf_counter() - t
                clock.native_calls += out is not None
                return out

        setattr(fused, name, wrapped)


def count_ops(events) -> dict[str, int]:
    """Top-level aten ops (not called from another aten op) per component range."""
    counts = dict.fromkeys([k for k, _ in COMPONENTS] + ["rest"], 0)
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent, kind = e.cpu_parent, "rest"
        while parent is not None and not parent.name.startswith("aten::"):
            if parent.name.startswith("component:") and kind == "rest":
                kind = parent.name.split(":", 1)[1]
            parent = parent.cpu_parent
        if parent is None:
            counts[kind] += 1
    return counts


def decode_paths(model: K3ForCausalLM) -> dict[str, dict | None]:
    """The decode paths of the model's tree, each as `set_fast_decode`'s arguments: `one call` (a step's
    layers in one native call: only its total is timed, no component is seen), `fused` (layer by layer: each
    component timed), `general`; a tree without set_fast_decode (k3 before the fused paths; PYTHONPATH=that
    tree) has one path, `original` (None)."""
    if not hasattr(model, "set_fast_decode"):
        return {"original": None}
    if not hasattr(model.model, "one_call_decode"):
        return {"fused": {"enabled": True}, "general": {"enabled": False}}
    one_call, layer_by_layer = {"enabled": True}, {"enabled": True, "one_call": False}
    return {"one call": one_call, "fused": layer_by_layer, "general": {"enabled": False}}


PROFILE_BLOCK = 10  # steps a path runs in its turn in the step profile


@torch.no_grad()
def step_profile(model: K3ForCausalLM, experts: str, context: int, steps: int) -> list[dict]:
    from torch.profiler import profile

    cfg = model.config
    label_components(model)
    clock = ComponentClock(model)
    wrap_fused(clock)
    paths = decode_paths(model)

    def select(setting: dict | None) -> K3ForCausalLM:
        return model if setting is None else model.set_fast_decode(**setting)

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (1, context), generator=gen)
    caches, tokens = {}, {}
    for path, setting in paths.items():
        caches[path] = model.new_cache(1)
        select(setting)(prompt, caches[path], logits_to_keep=1)
        tokens[path] = torch.tensor([[1]])
    times = {p: [] for p in paths}
    parts = {p: dict.fromkeys(clock.seconds, 0.0) for p in paths}

    def step(path: str) -> float:
        clock.reset()
        t = time.perf_counter()
        logits = model(tokens[path], caches[path])
        seconds = time.perf_counter() - t
        tokens[path] = logits[:, -1].argmax(-1, keepdim=True)
        return seconds

    # The paths take turns in blocks of PROFILE_BLOCK steps. A switch clears the model's decode plan
    # (set_fast_decode), so each block's first step, which builds it again, is not counted: switched at every
    # step, `mini`'s one-call step measured 15.4 ms at 2 threads, 9.1-9.3 in blocks, 8.5-9.2 alone (Zen 3).
    for start in range(0, steps, PROFILE_BLOCK):
        for path, setting in paths.items():
            select(setting)
            step(path)
            for _ in range(min(PROFILE_BLOCK, steps - start)):
                times[path].append(step(path))
                for k, v in clock.seconds.items():
                    parts[path][k] += v
    rows = []
    weights = component_bytes(model)
    for path, setting in paths.items():
        select(setting)
        step(path)  # the plan built again, outside the profile
        clock.native_calls = 0
        with profile() as prof:
            model(tokens[path], caches[path])
        ops = count_ops(prof.events())
        native_calls = clock.native_calls
        ms = 1e3 * statistics.median(times[path])
        rows.append(
            {
                "path": path,
                "experts": experts,
                "fused_calls": native_calls,
                "ms_per_token": ms,
                "component_ms": {k: 1e3 * v / steps for k, v in parts[path].items()},
                "aten_ops": sum(ops.values()),
                "aten_ops_by_component": ops,
                "component_bytes": weights,
            }
        )
    return rows


class ComponentClock:
    """Wall time per component (forward pre/post hooks), as MixerClock, for MoE, KDA, MLA, dense MLP."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = dict.fromkeys([k for k, _ in COMPONENTS], 0.0)
        self.native_calls = 0  # fused component steps that ran (k3.model.fused)
        self._start: dict[int, float] = {}
        inside_moe = {id(m) for moe in model.modules() if type(moe).__name__ == "MoE" for m in moe.modules()}
        for module in model.modules():
            kind = next((k for k, name in COMPONENTS if type(module).__name__ == name), None)
            if kind is None or (kind == "mlp" and id(module) in inside_moe):
                continue
            module.register_forward_pre_hook(lambda m, i: self._start.__setitem__(id(m), time.perf_counter()))
            module.register_forward_hook(lambda m, i, o, kind=kind: self._stop(m, kind))

    def _stop(self, module: torch.nn.Module, kind: str) -> None:
        self.seconds[kind] += time.perf_counter() - self._start.pop(id(module))

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def print_step_profile(rows: list[dict]) -> None:
    kinds = [k for k, _ in COMPONENTS]
    print(
        f"{'experts':>10} {'path':>8} {'ms/token':>9} "
        + " ".join(f"{k + ' ms':>8}" for k in kinds)
        + f" {'rest ms':>8} | {'aten ops':>8} "
        + " ".join(f"{k:>5}" for k in [*kinds, "rest"])
        + " | fused calls"
    )
    for r in rows:
        rest = r["ms_per_token"] - sum(r["component_ms"].values())
        print(
            f"{r['experts']:>10} {r['path']:>8} {r['ms_per_token']:9.2f} "
            + " ".join(f"{r['component_ms'][k]:8.2f}" for k in kinds)
            + f" {rest:8.2f} | "
            + f"{r['aten_ops']:8d} "
            + " ".join(f"{r['aten_ops_by_component'][k]:5d}" for k in [*kinds, "rest"])
            + f" | {r['fused_calls']:5d}"
        )


# ---- batched decode ------------------------------------------------------------------------------------
def as_loaded(model: K3ForCausalLM) -> K3ForCausalLM:
    """A preset's random model as `k3 generate` loads a checkpoint: inference weights (no gradient), laid out
    for the decode kernels (k3.model.tiling: its fp32 matrices together on huge pages). A model as
    `from_config` builds it keeps trainable weights where they are: `mini`'s steps 14.01 against 12.96 ms
    (medians of 8 alternated rounds, 2 threads, Zen 3, 2026-12-07;
    results/decode_mini_as_loaded_ab_zen3_1207.txt)."""
    model.requires_grad_(False)
    model.tile_weights()
    return model


@torch.no_grad()
def prefilled(model: K3ForCausalLM, batch: int, context: int, gen: torch.Generator):
    """`batch` sequences of random ids from `gen`, each prefilled alone to about `context` tokens (lengths 7
    apart), their caches stacked as the engine batches them: a ModelCache."""
    from k3.model.cache import ModelCache

    caches = []
    for b in range(batch):
        caches.append(model.new_cache(1))
        ids = torch.randint(0, model.config.vocab_size, (1, context - 7 * b), generator=gen)
        model(ids, caches[-1], logits_to_keep=1)
    return ModelCache.stack(caches)


@torch.no_grad()
def batch_throughput(model: K3ForCausalLM, batches: list[int], context: int, steps: int) -> list[dict]:
    """Decode tokens/s of B sequences in one step (`prefilled`), fused and general steps interleaved."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for B in batches:
        caches = {path: prefilled(model, B, context, gen) for path in ("fused", "general")}
        token = torch.ones(B, 1, dtype=torch.long)
        times: dict[str, list[float]] = {"fused": [], "general": []}
        for step in range(steps + 2):
            for path in ("fused", "general"):
                model.set_fast_decode(path == "fused")
                t = time.perf_counter()
                model(token, caches[path])
                if step >= 2:
                    times[path].append(time.perf_counter() - t)
        model.set_fast_decode(True)
        for path, ts in times.items():
            ms = 1e3 * statistics.median(ts)
            rows.append({"batch": B, "path": path, "ms_per_step": ms, "tokens_per_s": B * 1e3 / ms})
            print(
                f"[batch] B = {B:>2} {path:>7}: {ms:8.2f} ms/step = {B * 1e3 / ms:7.1f} tokens/s", flush=True
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--contexts", default="1024,8192,32768,65536", help="comma-separated context lengths")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per context")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-all-mla", action="store_true", help="only the hybrid model")
    ap.add_argument("--server", action="store_true", help="also measure server throughput")
    ap.add_argument("--streams", default="1,16", help="concurrent streams for --server")
    ap.add_argument("--server-tokens", type=int, default=32, help="tokens per stream for --server")
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--step-profile", action="store_true", help="only the decode step, fused vs general")
    ap.add_argument("--profile-context", type=int, default=256, help="prompt length before --step-profile")
    ap.add_argument("--checkpoint", help="--step-profile / --batch on this checkpoint instead of --preset")
    ap.add_argument("--batch", help="batched decode tokens/s at these batch sizes, e.g. 1,4,8")
    ap.add_argument("--untiled", action="store_true", help="--checkpoint's BF16 weights kept in rows")
    ap.add_argument(
        "--int8-expert-inputs", action="store_true", help="MXFP4 experts multiply inputs rounded to int8"
    )
    ap.add_argument(
        "--bf16-products", action="store_true", help="--checkpoint's BF16 weights paired for bf16 products"
    )
    args = ap.parse_args()
    if args.bf16_products and (args.untiled or not args.checkpoint):
        ap.error("--bf16-products pairs a --checkpoint's BF16 weights (not with --untiled)")
    torch.set_num_threads(args.threads)
    cfg = K3Config.preset(args.preset)

    def models() -> list[tuple[str, K3ForCausalLM]]:
        if args.checkpoint:
            # weights as the checkpoint stores them (BF16 matrices stay BF16: k3-slice in fp32 would not fit
            # 24 GB), computing in fp32
            model = K3ForCausalLM.from_pretrained(args.checkpoint, compute_dtype=torch.float32)
            if not args.untiled:
                model.tile_weights(args.bf16_products)  # as `k3 generate` loads it (k3.model.tiling)
            model.set_int8_expert_inputs(args.int8_expert_inputs)
            experts = "mxfp4" if model.config.experts_mxfp4 else "f32"
            modes = " int8" if args.int8_expert_inputs else ""
            return [(experts + modes + (" bf16 products" if args.bf16_products else ""), model)]
        return [
            (
                e,
                as_loaded(K3ForCausalLM.from_config(cfg, seed=0, quantized_experts=q)).set_int8_expert_inputs(
                    i8
                ),
            )
            for e, q, i8 in (("mxfp4", None, False), ("f32", False, False), ("mxfp4 int8", None, True))
            if args.int8_expert_inputs or not i8
        ]

    if args.batch:
        widest = max(int(b) for b in args.batch.split(","))
        if args.profile_context <= 7 * (widest - 1):  # sequence b is prefilled to context - 7 b tokens
            ap.error(f"--profile-context must exceed {7 * (widest - 1)} for a batch of {widest}")
        load = os.getloadavg()
        print(
            f"{args.checkpoint or args.preset}, {args.threads} threads, context ~{args.profile_context}; "
            f"load {load[0]:.2f}"
        )
        rows = batch_throughput(
            models()[0][1], [int(b) for b in args.batch.split(",")], args.profile_context, args.steps
        )
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"threads": args.threads, "load": load, "rows": rows}, f, indent=2)
        return
    if args.step_profile:
        load = os.getloadavg()
        print(
            f"{args.checkpoint or args.preset}, {args.threads} threads, context {args.profile_context}, "
            f"{args.steps} steps each; "
            f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs"
        )
        rows = [r for e, model in models() for r in step_profile(model, e, args.profile_context, args.steps)]
        print_step_profile(rows)
        print(machine_line())
        print_bandwidth(rows, read_bandwidth())
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"preset": args.preset, "threads": args.threads, "load": load, "rows": rows}, f, indent=2
                )
        return
    contexts = sorted(int(c) for c in args.contexts.split(","))
    results: dict = {"preset": args.preset, "threads": args.threads}
    if not args.skip_decode:
        hybrid = decode_curve(cfg, contexts, args.steps, f"{args.preset} hybrid")
        results["hybrid"] = hybrid
        first, last = hybrid[0], hybrid[-1]
        growth = last["kda_ms"] / first["kda_ms"] - 1
        print(f"KDA decode time {first['context']} -> {last['context']}: {growth:+.1%} (target <= +5%)")
        results["kda_growth"] = growth
        if not args.skip_all_mla:
            mla = decode_curve(all_mla(cfg), contexts, args.steps, f"{args.preset} all-MLA")
            results["all_mla"] = mla
            ratio = last["cache_bytes"] / mla[-1]["cache_bytes"]
            print(f"cache at {last['context']}: hybrid / all-MLA = {ratio:.1%} (target <= 30%)")
            results["cache_ratio"] = ratio
        n_mla = sum(p.mixer is Mixer.MLA for p in cfg.layer_plan)
        print(
            f"({n_mla} of {cfg.num_hidden_layers} layers are MLA: the ratio cannot go below "
            f"{n_mla / cfg.num_hidden_layers:.1%} at any length)"
        )
        k3 = K3Config.preset("k3")
        for ctx in (65536, 1048576):
            h, a = (
                cache_bytes_formula(k3, ctx, torch.bfloat16),
                cache_bytes_formula(all_mla(k3), ctx, torch.bfloat16),
            )
            print(
                f"K3 (formula, bf16) at {ctx}: hybrid {h['total'] / 2**30:.2f} GiB vs all-MLA "
                f"{a['total'] / 2**30:.2f} GiB = {h['total'] / a['total']:.1%}"
            )
    if args.server:
        streams = [int(s) for s in args.streams.split(",")]
        results["server"] = server_throughput(cfg, streams, args.server_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
