"""Inputs shared by the KDA tests (tests/ops/test_kda.py, test_kda_native.py): random q, k, v, beta with
gates of every kind, states, the state loops' inputs, and the relative RMS the tests compare by."""

from __future__ import annotations

import torch

from k3.ops.kda import kda_gate, kda_softplus_gate


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


def state_passing_inputs(steps, Z, C, K, V, seed, dtype=torch.float64):
    """StatePassing's inputs (q_gamma, w, u_in, k_hat, decay, state), random and requiring grad."""
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
