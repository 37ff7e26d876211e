"""KDA ops, chain of trust: the per-token loop (the spec) -> chunked form -> decode step.

External oracles: transformers' Kimi Linear fallbacks (``chunk_kimi_delta_attention``,
``recurrent_kimi_delta_attention``, ``KimiLinearForgetGate``) and the Glm5Next gate with a lower
bound (the K3 gate form).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

from k3.ops.kda import chunk as chunk_module
from k3.ops.kda import chunk_kda, kda_gate, kda_softplus_gate, naive_recurrent_kda, recurrent_kda_step
from k3.ops.kda.chunk import base_chunk_size, g_floor
from k3.ops.kda.native import load_native
from k3.ops.kda.state_passing import StatePassing


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(B, T, H, K, V, gate="k3", seed=0, dtype=torch.float32, gate_scale=1.0):
    """Random q, k, v, beta and a gate g of the given kind, all in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    f = torch.randn(B, T, H, K, generator=gen) * gate_scale
    A_log = torch.rand(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    if gate == "k3":
        g = kda_gate(f, A_log, dt_bias)
    elif gate == "softplus":
        g = kda_softplus_gate(f, A_log, dt_bias)
    elif gate == "near_zero":
        g = -1e-4 * torch.rand(B, T, H, K, generator=gen)
    elif gate == "minus5":
        g = torch.full((B, T, H, K), -5.0)
    elif gate == "minus50":
        g = torch.full((B, T, H, K), -50.0)
    elif gate == "minus200":  # beyond e^-80 per step: sub-blocks of one token
        g = torch.full((B, T, H, K), -200.0)
    elif gate == "mixed_huge":  # softplus-like: mostly huge steps, some tiny ones
        g = -50.0 * torch.rand(B, T, H, K, generator=gen) ** 4
    else:
        raise ValueError(gate)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def random_state(N, H, K, V, seed=1):
    return torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- chunk vs the per-token loop


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 300])
@pytest.mark.parametrize("gate", ["k3", "softplus"])
def test_chunk_matches_naive(T, gate):
    for (B, H, K, V), with_state in (((2, 2, 32, 16), True), ((1, 3, 16, 32), False)):
        q, k, v, g, beta = make_inputs(B, T, H, K, V, gate=gate, seed=T)
        h0 = random_state(B, H, K, V) if with_state else None
        o_ref, s_ref = naive_recurrent_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True
        )
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
        assert o.shape == (B, T, H, V) and o.dtype == torch.float32
        assert s.shape == (B, H, K, V) and s.dtype == torch.float32
        assert rel_rms(o, o_ref) <= 1e-5
        assert rel_rms(s, s_ref) <= 1e-5


@pytest.mark.parametrize("gate", ["near_zero", "minus5", "minus50", "minus200", "mixed_huge"])
@pytest.mark.parametrize("T", [65, 200])
def test_chunk_extreme_gates(gate, T):
    q, k, v, g, beta = make_inputs(1, T, 2, 32, 32, gate=gate, seed=3)
    h0 = random_state(1, 2, 32, 32)
    o_ref, s_ref = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True
    )
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(s, s_ref) <= 1e-5


def test_chunk_unnormalised_keys_and_scale():
    q, k, v, g, beta = make_inputs(1, 100, 2, 16, 8, gate="k3", seed=4)
    q, k = q * 0.3, k * 0.3  # delta rule stays contractive without the L2 norm for small keys
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, scale=0.7, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, scale=0.7, output_final_state=True)
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(s, s_ref) <= 1e-5


@pytest.mark.parametrize("chunk_size", [1, 32, 64, 128])
def test_chunk_sizes_agree(chunk_size):
    q, k, v, g, beta = make_inputs(1, 150, 2, 32, 32, gate="k3", seed=5)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk_size)
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(s, s_ref) <= 1e-5


def test_base_chunk_size_respects_the_exponent_limit():
    assert base_chunk_size(-5.0, 64) == 16  # K3's bound: 15 * 5 = 75 <= 80
    assert base_chunk_size(-1e-3, 64) == 64
    assert base_chunk_size(-50.0, 64) == 2
    assert base_chunk_size(-1e4, 64) == 1
    for g_min in (-0.3, -2.0, -7.0, -33.0):
        s = base_chunk_size(g_min, 128)
        assert (s - 1) * -g_min <= 80 and (s == 128 or (2 * s - 1) * -g_min > 80)


# ---------------------------------------------------------------- packing, continuation, decode


def test_cu_seqlens_equals_each_sequence_alone():
    H, K, V = 2, 16, 16
    lengths = [5, 0, 70, 64, 1, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta = make_inputs(1, sum(lengths), H, K, V, gate="k3", seed=6)
    h0 = random_state(len(lengths), H, K, V)
    o, s = chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu
    )
    assert o.shape == (1, sum(lengths), H, V) and s.shape == (len(lengths), H, K, V)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        piece = [x[:, start:end] for x in (q, k, v, g, beta)]
        o_i, s_i = naive_recurrent_kda(
            *piece, initial_state=h0[i : i + 1], output_final_state=True, use_qk_l2norm=True
        )
        if end > start:
            assert rel_rms(o[:, start:end], o_i) <= 1e-5
        assert rel_rms(s[i : i + 1], s_i) <= 1e-5


def test_cu_seqlens_rejects_bad_input():
    q, k, v, g, beta = make_inputs(1, 10, 1, 8, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="non-decreasing"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="B = 1"):
        q2, k2, v2, g2, b2 = make_inputs(2, 10, 1, 8, 8)
        chunk_kda(q2, k2, v2, g2, b2, cu_seqlens=torch.tensor([0, 10]))


def test_prefix_then_continuation_equals_one_pass():
    q, k, v, g, beta = make_inputs(2, 200, 2, 32, 16, gate="k3", seed=7)
    o_all, s_all = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    split = 77
    o1, s1 = chunk_kda(
        *(x[:, :split] for x in (q, k, v, g, beta)), output_final_state=True, use_qk_l2norm=True
    )
    o2, s2 = chunk_kda(
        *(x[:, split:] for x in (q, k, v, g, beta)),
        initial_state=s1,
        output_final_state=True,
        use_qk_l2norm=True,
    )
    assert rel_rms(torch.cat([o1, o2], dim=1), o_all) <= 1e-5
    assert rel_rms(s2, s_all) <= 1e-5


@pytest.mark.parametrize("decode_tokens", [1, 3])
def test_decode_step_continues_a_chunked_prefill(decode_tokens):
    T = 130 + decode_tokens
    q, k, v, g, beta = make_inputs(2, T, 3, 32, 16, gate="softplus", seed=8)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    _, state = chunk_kda(
        *(x[:, :130] for x in (q, k, v, g, beta)), output_final_state=True, use_qk_l2norm=True
    )
    state_before = state.clone()
    outs = []
    for t in range(130, T, 2):  # two tokens per call where possible
        piece = [x[:, t : min(t + 2, T)] for x in (q, k, v, g, beta)]
        o_t, state = recurrent_kda_step(*piece, initial_state=state, use_qk_l2norm=True)
        outs.append(o_t)
    assert torch.equal(
        state_before,
        chunk_kda(*(x[:, :130] for x in (q, k, v, g, beta)), output_final_state=True, use_qk_l2norm=True)[1],
    )
    assert rel_rms(torch.cat(outs, dim=1), o_ref[:, 130:]) <= 1e-5
    assert rel_rms(state, s_ref) <= 1e-5


def test_decode_step_matches_naive_from_zero_state_and_keeps_input_state():
    q, k, v, g, beta = make_inputs(1, 5, 2, 16, 8, gate="k3", seed=9)
    h0 = random_state(1, 2, 16, 8)
    h0_copy = h0.clone()
    o, s = recurrent_kda_step(q, k, v, g, beta, initial_state=h0, scale=0.5)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, scale=0.5, output_final_state=True)
    assert torch.equal(h0, h0_copy)
    assert rel_rms(o, o_ref) <= 1e-6 and rel_rms(s, s_ref) <= 1e-6
    o0, s0 = recurrent_kda_step(q, k, v, g, beta, output_final_state=False)
    assert s0 is None and rel_rms(o0, naive_recurrent_kda(q, k, v, g, beta)[0]) <= 1e-6


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("gate,T,chunk_size", [("k3", 45, 16), ("softplus", 37, 16), ("minus50", 20, 8)])
def test_chunk_gradients_match_naive(gate, T, chunk_size):
    B, H, K, V = 1, 2, 8, 4
    inputs = [x.double().requires_grad_() for x in make_inputs(B, T, H, K, V, gate=gate, seed=10)]
    h0 = random_state(B, H, K, V).double().requires_grad_()
    gen = torch.Generator().manual_seed(11)
    w_o = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    w_s = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)

    def grads(fn, **kw):
        o, s = fn(*inputs, initial_state=h0, output_final_state=True, use_qk_l2norm=True, **kw)
        loss = (o * w_o).sum() + (s * w_s).sum()
        return torch.autograd.grad(loss, [*inputs, h0])

    expected = grads(naive_recurrent_kda)
    actual = grads(chunk_kda, chunk_size=chunk_size)
    for name, a, e in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], actual, expected, strict=True):
        # relative, with an absolute floor: under a -50 gate dg is ~1e-23 and float64 rounding
        # of the O(1) terms that cancel inside it leaves ~1e-17
        assert (a - e).pow(2).mean().sqrt() <= 1e-9 * e.pow(2).mean().sqrt() + 1e-12, name


def test_chunk_gradients_fp32_k3_gate():
    B, T, H, K, V = 1, 150, 2, 32, 32
    inputs = [x.requires_grad_() for x in make_inputs(B, T, H, K, V, gate="k3", seed=12)]
    w = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(13))
    expected = torch.autograd.grad((naive_recurrent_kda(*inputs, use_qk_l2norm=True)[0] * w).sum(), inputs)
    actual = torch.autograd.grad((chunk_kda(*inputs, use_qk_l2norm=True)[0] * w).sum(), inputs)
    for a, e in zip(actual, expected, strict=True):
        assert torch.isfinite(a).all() and rel_rms(a, e) <= 1e-4


def state_passing_inputs(steps, Z, C, K, V, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return (torch.randn(*shape, generator=gen, dtype=dtype) * scale).requires_grad_()

    decay = torch.rand(steps, Z, K, generator=gen, dtype=dtype).requires_grad_()
    return (
        rand(steps, Z, C, K),
        rand(steps, Z, C, K),
        rand(steps, Z, C, V),
        rand(steps, Z, C, K),
        decay,
        rand(Z, K, V),
    )


def test_state_passing_backward_passes_gradcheck():
    # the hand-written adjoint loop (torch ops) against finite differences, every input, in float64
    inputs = state_passing_inputs(3, 2, 4, 5, 3, seed=15)
    assert torch.autograd.gradcheck(lambda *x: StatePassing.apply(*x, None), inputs)


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
@pytest.mark.parametrize(
    "steps,Z,C,K,V", [(5, 3, 16, 128, 128), (4, 2, 7, 13, 27), (3, 1, 1, 8, 8), (2, 2, 32, 64, 17)]
)
def test_native_state_passing_matches_torch_loops(steps, Z, C, K, V):
    # the C++ loops against the torch loops (themselves checked by gradcheck above), outputs and
    # every gradient, in fp32; odd sizes reach the kernel's short row blocks and single columns
    inputs = state_passing_inputs(steps, Z, C, K, V, seed=16, dtype=torch.float32)
    gen = torch.Generator().manual_seed(17)
    weights = [torch.randn(steps, Z, C, V, generator=gen) for _ in range(2)] + [
        torch.randn(Z, K, V, generator=gen)
    ]

    def run(native):
        outputs = StatePassing.apply(*inputs, native)
        loss = sum((o * w).sum() for o, w in zip(outputs, weights, strict=True))
        return [*outputs, *torch.autograd.grad(loss, inputs)]

    names = ["reads", "u", "final", "d_q_gamma", "d_w", "d_u_in", "d_k_hat", "d_decay", "d_state"]
    for name, a, e in zip(names, run(load_native()), run(None), strict=True):
        assert a.shape == e.shape and rel_rms(a, e) <= 1e-6, name


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
def test_native_product_variants_and_thread_counts_give_the_same_bits():
    # the chunk products in 16 lanes (AVX-512) and in 8 (AVX2), at 1 and 2 threads: every output and
    # gradient of the fused forward/backward and of the state loops bit for bit (each output element is
    # the same chain of FMAs in either width); shapes reach the 32- and 16-wide panels, the 8-wide and
    # single columns after them, and short row blocks
    native = load_native()
    variants = ["avx2", "avx512"] if native.products_variant() == "avx512" else ["avx2"]
    threads = torch.get_num_threads()

    def fused(case, variant):
        (q, k, v, g, beta), kwargs, N = fused_case(case, seed=31)
        rows = (
            [x[0].contiguous() for x in (q, k, v, g, beta)]
            if kwargs["cu_seqlens"] is not None
            else [x.reshape(-1, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
        )
        B, T = q.shape[:2]
        cu = kwargs["cu_seqlens"]
        starts = cu[:-1].contiguous() if cu is not None else torch.arange(B) * T
        lengths = (cu[1:] - cu[:-1]).contiguous() if cu is not None else torch.full((B,), T)
        h0 = kwargs["initial_state"]
        h0 = torch.zeros(N, q.shape[2], q.shape[3], v.shape[3]) if h0 is None else h0.detach()
        C = kwargs["chunk_size"]
        options = (C, g_floor(C), q.shape[3] ** -0.5, kwargs["use_qk_l2norm"], 1e-6)
        o, final, states, pseudo_values = native.forward(*rows, starts, lengths, h0, *options, True, variant)
        gen = torch.Generator().manual_seed(32)
        d_o, d_final = torch.randn(o.shape, generator=gen), torch.randn(final.shape, generator=gen)
        grads = native.backward(
            *rows, starts, lengths, h0, states, pseudo_values, d_o, d_final, *options, variant
        )
        return [o, final, states, pseudo_values, *grads]

    def loops(variant):
        inputs = [x.detach() for x in state_passing_inputs(3, 2, 16, 40, 56, seed=33, dtype=torch.float32)]
        q_gamma, w, u_in, k_hat, decay, state = inputs
        reads, u, final = native.state_forward(q_gamma, w, u_in, k_hat, decay, state, variant)
        states = native.state_history(k_hat, u, decay, state, variant)
        grads = native.state_backward(q_gamma, w, k_hat, decay, u, states, reads, u_in, final, variant)
        return [reads, u, final, states, *grads]

    try:
        runs = {}
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for variant in variants:
                outputs = [
                    fused(case, variant) for case in ("k3", "odd_dims", "chunk_8", "packed", "many_heads")
                ]
                runs[n_threads, variant] = [x for xs in outputs for x in xs] + loops(variant)
    finally:
        torch.set_num_threads(threads)
    reference = runs[1, "avx2"]
    for key, outputs in runs.items():
        assert all(torch.equal(a, e) for a, e in zip(outputs, reference, strict=True)), key
    with pytest.raises(RuntimeError, match="variant must be"):
        loops("sse")


class CountingNative:
    """The native module with a count of the fused forward calls (to know which path ran), of those that
    refused their g, and whether the last one kept the chunk-start states for the backward."""

    def __init__(self, module):
        self.module, self.forward_calls, self.refused, self.kept = module, 0, 0, None

    def __getattr__(self, name):
        return getattr(self.module, name)

    def forward(self, *args):
        self.forward_calls += 1
        self.kept = args[-1]
        try:
            return self.module.forward(*args)
        except self.module.GateOutOfRange:
            self.refused += 1
            raise


FUSED_CASES = {  # name: (B, T, H, K, V, gate, chunk_size, cu_seqlens, l2norm, initial state)
    "k3": (1, 100, 3, 32, 24, "k3", 16, None, True, True),
    "odd_dims": (2, 37, 2, 13, 27, "k3", 16, None, True, False),
    "no_l2norm": (1, 50, 2, 16, 16, "k3", 16, None, False, True),
    "chunk_8": (1, 45, 2, 16, 8, "minus5", 8, None, True, True),
    "chunk_1": (1, 9, 2, 8, 8, "minus200", 1, None, True, True),
    "chunk_4_near_zero": (1, 150, 2, 32, 32, "near_zero", 4, None, True, False),
    "packed": (1, 90, 2, 16, 16, "k3", 16, [0, 7, 7, 40, 90], True, True),
    # more heads than the native kernels run together (16): groups of 16 and 2 per sequence, or split
    # between threads
    "many_heads": (1, 41, 18, 8, 8, "k3", 16, [0, 17, 41], True, True),
}


def fused_case(case, seed, requires_grad=False):
    """(inputs, chunk_kda keyword arguments, number of sequences) of one FUSED_CASES entry."""
    B, T, H, K, V, gate, chunk_size, cu, l2, with_state = FUSED_CASES[case]
    inputs = [x.requires_grad_(requires_grad) for x in make_inputs(B, T, H, K, V, gate=gate, seed=seed)]
    N = B if cu is None else len(cu) - 1
    h0 = random_state(N, H, K, V).requires_grad_(requires_grad) if with_state else None
    kwargs = dict(
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm=l2,
        cu_seqlens=None if cu is None else torch.tensor(cu),
        chunk_size=chunk_size,
    )
    return inputs, kwargs, N


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_native_forward_matches_torch_path(monkeypatch, case):
    # without gradients chunk_kda runs one native call from token layout to token layout; the torch
    # path (checked against the per-token loop above) is the reference, outputs and final states
    (q, k, v, g, beta), kwargs, _ = fused_case(case, seed=18)
    native = CountingNative(load_native())
    monkeypatch.setattr(chunk_module, "load_native", lambda: native)
    fused = chunk_kda(q, k, v, g, beta, **kwargs)
    assert native.forward_calls == 1
    monkeypatch.setattr(chunk_module, "load_native", lambda: None)
    torch_only = chunk_kda(q, k, v, g, beta, **kwargs)
    for a, e in zip(fused, torch_only, strict=True):
        assert a.shape == e.shape and rel_rms(a, e) <= 2e-6


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
@pytest.mark.parametrize("case", FUSED_CASES)
@pytest.mark.parametrize("loss_on", ["both", "output", "state"])
@pytest.mark.parametrize("keep_states", [True, False])
def test_fused_native_backward_matches_torch_path(monkeypatch, case, loss_on, keep_states):
    # the fused backward (its own adjoint of every step) against autograd through the torch path, on
    # every input and the initial state, from the chunk-start states the forward kept or recomputed;
    # a loss on o only or the final state only leaves the other gradient None
    inputs, kwargs, N = fused_case(case, seed=20, requires_grad=True)
    kwargs["keep_states"] = keep_states
    h0 = kwargs["initial_state"]
    B, T, H, K = inputs[0].shape
    V = inputs[2].shape[-1]
    gen = torch.Generator().manual_seed(21)
    w_o, w_s = torch.randn(B, T, H, V, generator=gen), torch.randn(N, H, K, V, generator=gen)
    wrt = inputs if h0 is None else [*inputs, h0]

    def grads(native):
        monkeypatch.setattr(chunk_module, "load_native", lambda: native)
        o, s = chunk_kda(*inputs, **kwargs)
        loss = {
            "both": (o * w_o).sum() + (s * w_s).sum(),
            "output": (o * w_o).sum(),
            "state": (s * w_s).sum(),
        }
        return torch.autograd.grad(loss[loss_on], wrt, allow_unused=True)

    native = CountingNative(load_native())
    fused = grads(native)
    assert native.forward_calls == 1 and native.kept == keep_states
    for name, a, e in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], fused, grads(None), strict=False):
        # both are fp32 with the same terms in a different order: ~1e-7 apart, up to ~1e-5 under the
        # -5 gate, whose in-chunk factors reach e^35
        assert torch.isfinite(a).all() and rel_rms(a, e) <= 5e-5, name


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
def test_fused_native_forward_keeps_chunk_start_states():
    # what the forward keeps for the backward: per (sequence, head), chunk i's starting state
    # transposed, [V, K], which is the final state after the sequence's first i C tokens
    (q, k, v, g, beta), kwargs, N = fused_case("packed", seed=22)
    cu, C, h0 = kwargs["cu_seqlens"].tolist(), kwargs["chunk_size"], kwargs["initial_state"]
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    rows = (x[0].contiguous() for x in (q, k, v, g, beta))
    starts, lengths = torch.tensor(cu[:-1]), torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    _, _, states, pseudo_values = load_native().forward(
        *rows, starts, lengths, h0, C, g_floor(C), K**-0.5, True, 1e-6, True
    )
    expected = []
    for n in range(N):
        chunks = -(-(cu[n + 1] - cu[n]) // C)
        for h in range(H):
            for i in range(chunks):
                prefix = slice(cu[n], cu[n] + i * C)
                _, s = naive_recurrent_kda(
                    *(x[:, prefix, h : h + 1] for x in (q, k, v, g, beta)),
                    initial_state=h0[n : n + 1, h : h + 1],
                    output_final_state=True,
                    use_qk_l2norm=True,
                )
                expected.append(s[0, 0].T)
    assert states.shape == (len(expected), V, K) and pseudo_values.shape == (len(expected), C, V)
    assert rel_rms(states, torch.stack(expected)) <= 1e-5


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
def test_native_paths_by_chunk_shape(monkeypatch):
    # one base chunk per chunk: the fused kernels, with or without gradients, bf16 in -> bf16 out;
    # chunks built by merges (a larger chunk, or a gate too steep for one base chunk): torch + state loop
    native = CountingNative(load_native())
    monkeypatch.setattr(chunk_module, "load_native", lambda: native)
    q, k, v, g, beta = make_inputs(1, 40, 2, 16, 16, gate="k3", seed=19)
    chunk_kda(q, k, v, g, beta.requires_grad_())
    assert native.kept  # for the backward
    with torch.no_grad():
        chunk_kda(q, k, v, g, beta)
    assert native.forward_calls == 2 and not native.kept
    o, _ = chunk_kda(*(x.detach().bfloat16() for x in (q, k, v, g, beta)), use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and native.forward_calls == 3
    chunk_kda(q, k, v, g, beta, chunk_size=32)
    assert native.forward_calls == 3 and native.refused == 0
    # a gate too steep for one base chunk: the fused forward refuses it in its first chunk
    chunk_kda(q, k, v, torch.full_like(g, -50.0), beta)
    assert native.forward_calls == 4 and native.refused == 1


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
@pytest.mark.parametrize("with_grad", [False, True])
def test_a_steep_step_late_in_one_head_takes_the_torch_path(monkeypatch, with_grad):
    # the fused forward checks each chunk's g as it reads it (no pass over g before the call): one step
    # below the floor, in the last chunk of one head of the second sequence, makes it refuse the whole
    # call; chunk_kda then returns the torch path's o, final state and gradients, which match the per-token
    # loop. The same step at the floor itself is taken by the fused kernels.
    q, k, v, g, beta = make_inputs(2, 40, 3, 16, 16, gate="k3", seed=41)
    native = CountingNative(load_native())
    monkeypatch.setattr(chunk_module, "load_native", lambda: native)
    floor = g_floor(16)
    # -60: the fused kernels' exponents would overflow (e^130 in that chunk); just below and at the floor
    cases = [(-60.0, 1), (floor * (1 + 1e-6), 2), (floor, 2)]
    for calls, (step, refused) in enumerate(cases, start=1):
        g_steep = g.clone()
        g_steep[1, 38, 2, 5] = step
        inputs = [x.clone().requires_grad_(with_grad) for x in (q, k, v, g_steep, beta)]
        kwargs = dict(output_final_state=True, use_qk_l2norm=True)
        o, s = chunk_kda(*inputs, **kwargs)
        assert native.forward_calls == calls and native.refused == refused
        o_ref, s_ref = naive_recurrent_kda(*(x.detach() for x in inputs), **kwargs)
        assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(s, s_ref) <= 1e-5
        if with_grad:
            w = torch.randn(o.shape, generator=torch.Generator().manual_seed(42))
            grads = torch.autograd.grad((o * w).sum() + s.sum(), inputs)
            leaves = [x.detach().clone().requires_grad_() for x in inputs]
            o_ref, s_ref = naive_recurrent_kda(*leaves, **kwargs)
            expected = torch.autograd.grad((o_ref * w).sum() + s_ref.sum(), leaves)
            for name, a, e in zip("q k v g beta".split(), grads, expected, strict=True):
                assert rel_rms(a, e) <= 1e-4, name


# ---------------------------------------------------------------- dtypes, errors


def test_bf16_inputs():
    q, k, v, g, beta = make_inputs(1, 100, 2, 32, 32, gate="k3", seed=14, dtype=torch.bfloat16)
    o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o_ref, s_ref = naive_recurrent_kda(
        *(x.float() for x in (q, k, v, g, beta)), output_final_state=True, use_qk_l2norm=True
    )
    assert rel_rms(o, o_ref) <= 1e-2 and rel_rms(s, s_ref) <= 1e-5
    o_step, _ = recurrent_kda_step(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], use_qk_l2norm=True)
    assert o_step.dtype == torch.bfloat16 and rel_rms(o_step, o_ref[:, :3]) <= 1e-2


def test_shape_and_value_errors():
    q, k, v, g, beta = make_inputs(1, 10, 2, 8, 4)
    with pytest.raises(ValueError, match="v must be"):
        chunk_kda(q, k, v[:, :5], g, beta)
    with pytest.raises(ValueError, match="beta must be"):
        naive_recurrent_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_kda_step(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="<= 0"):
        chunk_kda(q, k, v, g.abs() + 0.1, beta)
    with pytest.raises(ValueError, match="power of two"):
        chunk_kda(q, k, v, g, beta, chunk_size=48)


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
def test_native_kernels_check_their_inputs():
    # the C++ entry points validate what they are given instead of reading out of bounds
    native = load_native()
    q, k, v, g, beta = (x[0].contiguous() for x in make_inputs(1, 10, 2, 8, 4))
    state = torch.zeros(1, 2, 8, 4)

    def forward(starts, lengths, **changes):
        args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state) | changes
        sequences = dict(starts=torch.tensor(starts), lengths=torch.tensor(lengths))
        options = dict(chunk_size=16, g_floor=g_floor(16), scale=0.5, l2norm=True, eps=1e-6)
        return native.forward(**args, **sequences, **options, keep=True)

    with pytest.raises(RuntimeError, match="cover 8 rows, not all 10"):
        forward([0], [8])
    with pytest.raises(RuntimeError, match="does not start where"):
        forward([0, 3], [5, 5], initial_state=torch.zeros(2, 2, 8, 4))
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        forward([0], [10], q=q.double())
    with pytest.raises(RuntimeError, match="initial_state must be"):
        forward([0], [10], initial_state=torch.zeros(2, 2, 8, 4))
    with pytest.raises(RuntimeError, match="k and g must have q's shape"):
        forward([0], [10], k=k[:, :1].contiguous())
    # g out of [g_floor, 0] in one element (a ValueError: chunk.py then runs its torch path)
    for bad in (g_floor(16) - 0.01, 0.01):
        g_bad = g.clone()
        g_bad[7, 1, 3] = bad
        with pytest.raises(native.GateOutOfRange, match="g leaves"):
            forward([0], [10], g=g_bad)
        assert issubclass(native.GateOutOfRange, ValueError)
    assert forward([0, 4], [4, 6], initial_state=torch.zeros(2, 2, 8, 4))[0].shape == (10, 2, 4)
    _, _, states, pseudo_values = forward([0], [10])

    def backward(**changes):
        args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, states=states) | changes
        sequences = dict(starts=torch.tensor([0]), lengths=torch.tensor([10]))
        grads = dict(d_o=torch.ones_like(v), d_final=torch.zeros_like(state))
        options = dict(chunk_size=16, g_floor=g_floor(16), scale=0.5, l2norm=True, eps=1e-6)
        return native.backward(**args, **sequences, pseudo_values=pseudo_values, **grads, **options)

    assert backward()[0].shape == q.shape
    with pytest.raises(RuntimeError, match="g leaves"):
        backward(g=torch.full_like(g, -6.0))
    with pytest.raises(RuntimeError, match="states must be"):
        backward(states=states[:, :2].contiguous())
    with pytest.raises(RuntimeError, match="states must be"):
        backward(states=torch.cat([states, states]))


def test_empty_sequence():
    q, k, v, g, beta = make_inputs(1, 0, 2, 8, 4)
    h0 = random_state(1, 2, 8, 4)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (1, 0, 2, 4) and torch.equal(s, h0)


# ---------------------------------------------------------------- transformers as an external oracle


def _transformers_kimi():
    import transformers.models.kimi_linear.modeling_kimi_linear as kimi_linear

    return kimi_linear


@pytest.mark.parametrize("T", [50, 130])
def test_matches_transformers_fallbacks(T):
    tr = _transformers_kimi()
    q, k, v, g, beta = make_inputs(2, T, 2, 32, 32, gate="softplus", seed=15)
    h0 = random_state(2, 2, 32, 32)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_chunk_tr, s_chunk_tr = tr.chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, **kw)
    o_rec_tr, s_rec_tr = tr.recurrent_kimi_delta_attention(q, k, v, g=g, beta=beta, **kw)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o_n, s_n = naive_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True
    )
    assert rel_rms(o, o_chunk_tr) <= 1e-5 and rel_rms(s, s_chunk_tr) <= 1e-5
    assert rel_rms(o_n, o_rec_tr) <= 1e-6 and rel_rms(s_n, s_rec_tr) <= 1e-6


def _gate_config(H, K, lower_bound=None):
    return types.SimpleNamespace(
        hidden_size=24, linear_head_dim=K, linear_num_heads=H, linear_lower_bound=lower_bound
    )


def test_softplus_gate_matches_transformers():
    tr = _transformers_kimi()
    torch.manual_seed(0)
    H, K = 3, 8
    module = tr.KimiLinearForgetGate(_gate_config(H, K))
    torch.nn.init.normal_(module.A_log)
    torch.nn.init.normal_(module.dt_bias, std=3.0)
    x = torch.randn(2, 5, 24) * 4
    expected = module(x)  # [B, T, H, K]
    f = module.f_b_proj(module.f_a_proj(x))  # [B, T, H*K]
    with torch.no_grad():
        assert torch.allclose(
            kda_softplus_gate(f, module.A_log, module.dt_bias), expected.flatten(-2), atol=1e-5
        )
        assert torch.allclose(
            kda_softplus_gate(f.view(2, 5, H, K), module.A_log, module.dt_bias), expected, atol=1e-5
        )


def test_bounded_gate_matches_glm5_next_and_uses_first_heads_of_padded_A_log():
    import transformers.models.glm5_next.modeling_glm5_next as glm

    torch.manual_seed(0)
    H, K = 3, 8
    module = glm.Glm5NextTextForgetGate(_gate_config(H, K, lower_bound=-5.0))
    torch.nn.init.normal_(module.A_log)
    torch.nn.init.normal_(module.dt_bias)
    x = torch.randn(2, 5, 24) * 4
    expected = module(x)  # [B, T, H, K]
    f = module.f_b_proj(module.f_a_proj(x)).detach()
    padded = torch.cat([module.A_log.detach(), torch.full((125,), 9.0)])  # K3 stores 128 entries
    g = kda_gate(f.view(2, 5, H, K), padded, module.dt_bias.detach())
    assert torch.allclose(g, expected.detach(), atol=1e-6)
    assert torch.allclose(kda_gate(f, padded, module.dt_bias.detach(), num_heads=H).view(2, 5, H, K), g)
    assert (g < 0).all() and (g >= -5).all()  # sigmoid saturates to 1 in fp32: the bound is reached


def test_gate_formulas_and_errors():
    torch.manual_seed(0)
    H, K = 2, 4
    f = torch.randn(3, H, K)
    A_log, dt_bias = torch.randn(H), torch.randn(H * K)
    x = f + dt_bias.view(H, K)
    rate = A_log.exp().view(H, 1)
    assert torch.allclose(kda_gate(f, A_log, dt_bias, lower_bound=-2.0), -2.0 * torch.sigmoid(rate * x))
    softplus = torch.log1p(torch.exp(x))
    assert torch.allclose(kda_softplus_gate(f, A_log, dt_bias), -rate * softplus, atol=1e-6)
    big = kda_softplus_gate(torch.full((1, H, K), 1e4), A_log, dt_bias)
    assert torch.isfinite(big).all() and math.isclose(
        big[0, 0, 0].item(), -(1e4 + dt_bias[0].item()) * rate[0].item(), rel_tol=1e-5
    )
    assert kda_gate(f.to(torch.bfloat16), A_log, dt_bias).dtype == torch.float32
    with pytest.raises(ValueError, match="fewer than"):
        kda_gate(f, A_log[:1], dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(torch.randn(3, 5), A_log, dt_bias)
