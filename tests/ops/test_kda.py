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
from kda_cases import make_inputs, random_state, rel_rms, state_passing_inputs

from k3.ops.kda import chunk_kda, kda_gate, kda_softplus_gate, naive_recurrent_kda, recurrent_kda_step
from k3.ops.kda.chunk import base_chunk_size
from k3.ops.kda.state_passing import StatePassing


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


def test_state_passing_backward_passes_gradcheck():
    # the hand-written adjoint loop (torch ops) against finite differences, every input, in float64
    inputs = state_passing_inputs(3, 2, 4, 5, 3, seed=15)
    assert torch.autograd.gradcheck(lambda *x: StatePassing.apply(*x, None), inputs)


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
