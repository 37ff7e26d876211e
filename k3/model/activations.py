"""The gated activations of the MLPs and experts: `act(gate, up)`.

* SiLU-GLU (Kimi Linear): `silu(g) * u`
* SiTU (K3, a soft-capped SwiGLU): `b*tanh(g/b)*sigmoid(g) * c*tanh(u/c)`, b = activation_situ_beta,
  c = activation_situ_linear_beta: both factors are bounded, by b and c. `activation_situ_linear_beta: null`
  leaves the up projection uncapped (`... * u`), as the release's SiTU reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.ops.decode.native import load_native

GatedActivation = Callable[..., torch.Tensor]  # act(gate, up, native=False): fused_gated
NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # what the native activation takes (fused_gated)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def situ(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0
) -> torch.Tensor:
    capped = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * capped


def situ_parameters(cfg: K3Config) -> tuple[float, float | None] | None:
    """(beta, linear_beta) of SiTU, or None for SiLU-GLU: the activation as the native kernels take it
    (linear_beta None: uncapped, which they do not implement: callers take the torch path)."""
    return (cfg.activation_situ_beta, cfg.activation_situ_linear_beta) if cfg.hidden_act == "situ" else None


def native_activation(situ: tuple[float, float | None] | None) -> tuple[int, float, float]:
    """The native kernels' (act, beta, linear_beta): SiLU-GLU (0) or SiTU (1) with its two parameters."""
    return (0, 0.0, 0.0) if situ is None else (1, *situ)  # type: ignore[return-value]


def fused_gated(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    native_args: tuple[int, float, float] | None,
    native: bool = False,
) -> torch.Tensor:
    """`reference(gate, up)`, or with `native` (a model in inference that asked for it:
    `K3ForCausalLM.set_native_activations`) one native pass: fp32 or bf16 CPU tensors of one shape, computed
    in fp32 with vectorised tanh, sigmoid and exp (within 1e-6 relative of float64,
    tests/ops/test_native_math.py), a bf16 result rounded once. Torch's ops read and write the tensor once per
    op (nine for SiTU) and round bf16 after each: a prefill chunk of k3-slice's first-layer MLP ([293,
    33792]) took 64 ms in bf16 and 130 ms in fp32 that way, 19 and 14 natively (2 threads, EPYC Zen 4). The
    values differ from torch's in the last bits, so it is never the default: a model in training, or a frozen
    copy of it (a teacher equal to its student), must give torch's numbers. Inputs that need a gradient,
    other dtypes and devices, `native_args` None (an uncapped SiTU, which the kernels do not implement) and a
    missing build take `reference` too."""
    wants_grad = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    same = up.dtype == gate.dtype and up.shape == gate.shape
    module = None
    if native and not wants_grad and native_args is not None and same and gate.device.type == "cpu":
        module = load_native() if gate.dtype in NATIVE_DTYPES else None
    if module is None:
        return reference(gate, up)
    return module.gated_activation(gate, up, *native_args)


def gated_activation(cfg: K3Config) -> GatedActivation:
    """The config's `hidden_act` as `act(gate, up, native=...)`: `fused_gated` over its definition."""
    parameters = situ_parameters(cfg)
    if parameters is None:
        return partial(fused_gated, reference=silu_glu, native_args=native_activation(None))
    reference = partial(situ, beta=parameters[0], linear_beta=parameters[1])
    native_args = None if parameters[1] is None else native_activation(parameters)
    return partial(fused_gated, reference=reference, native_args=native_args)
