"""Benchmark the KDA ops: k3's chunk_kda against transformers' chunk fallback and the per-token loop.

One run, same inputs for everyone: B=1, H=8, K=V=128, fp32, K3's bounded gate, L2-normalised q/k.
For each T and H it prints time, tokens/s, achieved GFLOP/s and its share of this machine's fp32 GEMM
rate (a 2048^3 torch.mm, k3.ops.roofline, timed in the same rounds as chunk_kda, the two alternated: the
share of their bests, and the median of each round's share; the CPU, its SIMD features, threads, load and
streaming read bandwidth are printed first), the speed-up over transformers, and forward+backward time
with its ratio to the forward (alternated the same way: the ratio of their bests, and the median of each
round's ratio).

Two FLOP counts: fla's chunk count, 6 T d^2 + 3 T C d + T C^2 per head with C = 64 whatever chunk k3
runs (issue 40's target 4: >= 70 % of GEMM at T = 4096, H = 8 and H = 96, d = 128), and k3's own count of
what its chunks compute: Then the decode step: time per token after contexts of 1k and 64k tokens
(the state is [B, H, K, V] whatever the context, so the time must not grow).

FLOPs counted for chunk_kda, per token and head, with base chunks of s = 16 tokens merged up to
chunks of C (the masked upper halves of the products are counted, since they are computed; the
triangular inverses and every elementwise op are not):
    base     [q; k] (k decayed)^T 4 s K, W = solve (k Gamma) 2 s K, U = solve v 2 s V
    merges   c (3 K + V) for each level c = s, 2s, ..., C / 2
    loop     [q Gamma; W] S 4 K V, S <- Gamma_C S + K_hat^T u 2 K V
    output   o = q Gamma S + P u 2 C V
    (C = s = 16, K = V = 128: 118,784; C = 64: 155,648; fla's count at C = 64: 126,976)
With the native kernels built (`make native`) chunk_kda runs the fused forward and backward of
k3/ops/kda/fused.py here (K3's gate, chunk 16); without them, the torch path (autograd through the
parallel parts, the hand-written adjoint loop of StatePassing). The same FLOPs are counted for both.
Forward+backward (the forward under autograd, then the gradients of q, k, v, g and beta for a given
gradient of o, so that no loss around it is timed) runs twice: as chunk_kda does it by default (the
forward keeps every chunk's starting state for the backward) and with ``keep_states=False`` (the
backward recomputes them).
Where the native kernels run, their two calls are also timed alone (the forward, the forward keeping
states and the backward alternated round by round) with the chunk products in 8 lanes (AVX2) and, on CPUs
with AVX-512 F, in 16 (the default there; the same bits), beside each other.
The forward's kept states are large fresh buffers (twice the inputs), so how the allocator serves
them matters: ``--train-allocator`` times everything with freed memory kept in the process, as
``k3 train`` runs.

Run: ``.venv/bin/python benchmarks/kda.py [--lengths 1024 4096 16384] [--heads 8 96]
[--skip-peer-above 4096] [--train-allocator]``.
Timings on a shared machine are noisy: each figure is the best of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from k3.ops.kda import chunk_kda, kda_gate, naive_recurrent_kda, recurrent_kda_step
from k3.ops.kda.chunk import g_floor
from k3.ops.kda.native import load_native
from k3.ops.roofline import gemm, machine_line, references, references_line
from k3.train.allocator import keep_freed_memory


def best_time(fn: Callable[[], object], repeats: int, warm_up: bool = True) -> float:
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def alternated(*calls: Callable[[], object], rounds: int) -> list[list[float]]:
    """Times of each call, run one after the other in each round (after one warm-up each): on a shared
    machine a ratio of two bests taken minutes apart moves with the machine, one of the same rounds much
    less."""
    for call in calls:
        call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for call, out in zip(calls, times, strict=True):
            start = time.perf_counter()
            call()
            out.append(time.perf_counter() - start)
    return times


def fla_chunk_flops(T: int, H: int, d: int, C: int = 64) -> float:
    """fla's count for the chunked forward: 6 T d^2 + 3 T C d + T C^2 per head (d = K = V, chunk C)."""
    return H * (6 * T * d * d + 3 * T * C * d + T * C * C)


def chunk_kda_flops(T: int, H: int, K: int, V: int, chunk_size: int, base: int = 16) -> float:
    s = min(base, chunk_size)
    per_token = 4 * s * K + 2 * s * K + 2 * s * V + 6 * K * V + 2 * chunk_size * V
    c = s
    while c < chunk_size:
        per_token += c * (3 * K + V)
        c *= 2
    return -(-T // chunk_size) * chunk_size * H * per_token


def make_inputs(T: int, H: int, K: int, V: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    f = torch.randn(1, T, H, K, generator=gen)
    g = kda_gate(f, torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen))
    return q, k, v, g, beta


def transformers_chunk():
    try:
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    except ImportError:
        return None
    return chunk_kimi_delta_attention


def bench_one_length(args: argparse.Namespace, T: int, H: int) -> None:
    K, V, C = args.head_dim, args.head_dim, args.chunk_size
    q, k, v, g, beta = make_inputs(T, H, K, V)
    product, product_flops = gemm()
    t_k3s, t_gemms = alternated(
        lambda: chunk_kda(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=C), product, rounds=args.repeats
    )
    t_k3, gemm_rate, fla_flops = min(t_k3s), product_flops / min(t_gemms) / 1e9, fla_chunk_flops(T, H, K)
    rate = chunk_kda_flops(T, H, K, V, C) / t_k3 / 1e9
    fla_rate = fla_flops / t_k3 / 1e9
    # the share in each round: chunk_kda's rate by fla's count over the GEMM's of the same round
    shares = sorted(fla_flops / t * t_gemm / product_flops for t, t_gemm in zip(t_k3s, t_gemms, strict=True))
    peer = transformers_chunk() if T <= args.skip_peer_above and H <= args.skip_peer_heads_above else None
    t_peer = None
    if peer is not None:
        run_peer = lambda: peer(q, k, v, g=g, beta=beta, chunk_size=64, use_qk_l2norm_in_kernel=True)  # noqa: E731
        t_peer = best_time(run_peer, repeats=1, warm_up=False)
    speedup = f"{t_peer / t_k3:8.1f}x" if t_peer else f"{'-':>9}"
    columns = f"{fla_rate:8.1f} {100 * fla_rate / gemm_rate:6.1f}% {rate:8.1f} {100 * rate / gemm_rate:6.1f}%"
    print(f"{T:>6} {H:>3} {'k3 chunk_kda':<14} {t_k3:9.4f} {T / t_k3:10.0f} {columns} {speedup}")
    median, low, high = (100 * shares[at] for at in (len(shares) // 2, 0, -1))
    print(
        f"{'':>25}fp32 GEMM in the same rounds: best {gemm_rate:.1f} GFLOP/s; the median of the rounds' "
        f"shares by fla's count {median:.1f}% (from {low:.1f} to {high:.1f})"
    )
    if t_peer:
        print(f"{T:>6} {H:>3} {'transformers':<14} {t_peer:9.4f} {T / t_peer:10.0f}")
    if T <= args.naive_max and H <= args.skip_peer_heads_above:
        t_naive = best_time(lambda: naive_recurrent_kda(q, k, v, g, beta, use_qk_l2norm=True), 1, False)
        print(f"{T:>6} {H:>3} {'naive loop':<14} {t_naive:9.4f} {T / t_naive:10.0f}")
    if T <= args.backward_max:
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        d_o = torch.randn(1, T, H, V)  # the gradient arriving at o: KDA's own work only, no loss to time

        def forward_backward(keep_states: bool) -> None:
            o, _ = chunk_kda(*leaves, use_qk_l2norm=True, chunk_size=C, keep_states=keep_states)
            torch.autograd.grad(o, leaves, grad_outputs=d_o)

        def forward() -> None:
            chunk_kda(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=C)

        for keep_states, name in [(True, "fwd+bwd"), (False, "  recomputing")]:
            t_f, t_fb = alternated(
                forward, functools.partial(forward_backward, keep_states), rounds=args.repeats
            )
            by_round = sorted(b / a for a, b in zip(t_f, t_fb, strict=True))[len(t_f) // 2]
            blank = f"{'':>33}"
            print(
                f"{T:>6} {H:>3} {name:<14} {min(t_fb):9.4f} {T / min(t_fb):10.0f} {blank} "
                f"{min(t_fb) / min(t_f):7.2f}x fwd (median of the rounds' ratios {by_round:.2f}x)"
            )


def bench_product_variants(args: argparse.Namespace, T: int, H: int) -> None:
    """The fused native calls with the chunk products in 8 lanes (AVX2) and in 16 (AVX-512, same bits)."""
    native = load_native()
    if native is None or args.chunk_size != 16:
        return
    K = V = args.head_dim
    rows = [x.reshape(T, *x.shape[2:]).contiguous() for x in make_inputs(T, H, K, V)]
    sequence, state = (torch.tensor([0]), torch.tensor([T])), torch.zeros(1, H, K, V)
    options = (args.chunk_size, g_floor(args.chunk_size), K**-0.5, True, 1e-6)
    d_o, d_final = torch.randn(T, H, V), torch.zeros_like(state)
    times = {}
    for variant in ["avx2", "avx512"] if native.products_variant() == "avx512" else ["avx2"]:
        forward = functools.partial(native.forward, *rows, *sequence, state, *options)
        _, _, states, pseudo_values = forward(True, variant)
        kept = (states, pseudo_values)
        backward = functools.partial(native.backward, *rows, *sequence, state, *kept, d_o, d_final, *options)
        rounds = alternated(
            functools.partial(forward, False, variant),
            functools.partial(forward, True, variant),
            functools.partial(backward, variant),
            rounds=args.repeats,
        )
        times[variant] = [min(t) for t in rounds]
        fwd, fwd_keep, bwd = times[variant]
        by_round = sorted((k + b) / f for f, k, b in zip(*rounds, strict=True))[len(rounds[0]) // 2]
        print(
            f"{T:>6} {H:>3} native {variant:<6}  forward {fwd:.4f} s, keeping states {fwd_keep:.4f} s, "
            f"backward {bwd:.4f} s: (keeping + backward) / forward {(fwd_keep + bwd) / fwd:.2f}x "
            f"(median of the rounds' ratios {by_round:.2f}x)"
        )
    if len(times) == 2:
        ratios = ", ".join(f"{a / b:.2f}x" for a, b in zip(times["avx2"], times["avx512"], strict=True))
        print(f"{T:>6} {H:>3} 16-lane products faster by (forward, keeping, backward): {ratios}")


def bench_decode_after(args: argparse.Namespace, context: int) -> None:
    H, K, V = args.heads[0], args.head_dim, args.head_dim
    q, k, v, g, beta = make_inputs(context + args.decode_tokens, H, K, V, seed=1)
    prefix = (x[:, :context] for x in (q, k, v, g, beta))
    _, state = chunk_kda(*prefix, use_qk_l2norm=True, output_final_state=True)
    tokens = [[x[:, t : t + 1] for x in (q, k, v, g, beta)] for t in range(context, q.shape[1])]

    def decode() -> None:
        s = state
        for token in tokens:
            _, s = recurrent_kda_step(*token, initial_state=s, use_qk_l2norm=True)

    per_token = best_time(decode, args.repeats) / args.decode_tokens
    print(f"  after {context:>6} tokens: {per_token * 1e6:8.1f} us/token, state {tuple(state.shape)}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, nargs="+", default=[8, 96], help="heads H (K3 has 96)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-peer-above", type=int, default=4096, help="skip transformers above this T")
    parser.add_argument("--skip-peer-heads-above", type=int, default=8, help="and above this H")
    parser.add_argument("--naive-max", type=int, default=1024, help="run the per-token loop up to this T")
    parser.add_argument("--backward-max", type=int, default=16384, help="time forward+backward up to this T")
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 65536])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument(
        "--train-allocator",
        action="store_true",
        help="keep freed memory in the process, as `k3 train` does (k3.train.allocator)",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.train_allocator:
        print(f"glibc keeps freed memory (as in k3 train): {keep_freed_memory()}")

    print(f"{machine_line()}\n{references_line(references(args.repeats))}")
    K, C = args.head_dim, args.chunk_size
    print(f"\nprefill: B=1 K=V={K} fp32, chunk_size={C}; GFLOP/s by fla's count (C = 64), then by k3's own")
    columns = f"{'fla GF/s':>8} {'% GEMM':>7} {'own GF/s':>8} {'% GEMM':>7}"
    print(f"{'T':>6} {'H':>3} {'impl':<14} {'time s':>9} {'tok/s':>10} {columns} {'speed-up':>9}")
    for H in args.heads:
        for T in args.lengths:
            bench_one_length(args, T, H)
            bench_product_variants(args, T, H)
    H = args.heads[0]
    print(f"\ndecode: recurrent_kda_step, one token per call, B=1 H={H} K=V={K}")
    for context in args.decode_contexts:
        bench_decode_after(args, context)


if __name__ == "__main__":
    main()
