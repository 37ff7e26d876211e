"""The native KDA kernels against the torch path (itself checked against the per-token loop in
test_kda.py): the state loops, the fused chunked forward and backward on every chunk shape, their bits across
product widths and thread counts, g out of range, and the entry points' input checks."""

from __future__ import annotations

import pytest
import torch
from kda_cases import make_inputs, random_state, rel_rms, state_passing_inputs

from k3.ops.kda import chunk as chunk_module
from k3.ops.kda import chunk_kda, naive_recurrent_kda
from k3.ops.kda.chunk import g_floor
from k3.ops.kda.native import load_native
from k3.ops.kda.state_passing import StatePassing


@pytest.mark.skipif(load_native() is None, reason="native kernels not built: python -m k3.ops.build")
@pytest.mark.parametrize(
    "steps,Z,C,K,V", [(5, 3, 16, 128, 128), (4, 2, 7, 13, 27), (3, 1, 1, 8, 8), (2, 2, 32, 64, 17)]
)
def test_native_state_passing_matches_torch_loops(steps, Z, C, K, V):
    # the C++ loops against the torch loops (themselves checked by gradcheck in test_kda.py), outputs and
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
    # path (checked against the per-token loop in test_kda.py) is the reference, outputs and final states
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
