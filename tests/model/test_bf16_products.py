"""BF16 weights paired for bf16 products (k3.model.tiling, k3/ops/decode/_native_paired.h): the decode
kernels multiply them by their vectors rounded to bfloat16 with vdpbf16ps, fp32 sums.

References: float64 products of the same rounded vectors (torch's round to nearest even), the same products
of vectors rounded toward zero (a kernel that truncated would sit near those instead), the layout written
out by torch ops, the exact model (the logits move, but little), and each sequence decoded alone (a row's
value depends on nothing but its weights and its vector: the same bits in a batch, at any thread count).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_tiling import bf16_model, gen, logits

from k3.errors import K3Error
from k3.model.tiling import is_paired, is_tiled, matrix_shape, rows_of
from k3.ops.decode.native import load_native

NATIVE = load_native()
pytestmark = pytest.mark.skipif(
    NATIVE is None and os.environ.get("CI") != "true", reason="native kernels unavailable (k3 doctor)"
)


def supported() -> bool:
    return NATIVE is not None and NATIVE.bf16_products_supported()


def by_torch(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] in the paired layout written out from its definition: [N/16, K/2, 16 rows, 2 columns]."""
    N, K = w.shape
    return w.view(N // 16, 16, K // 2, 2).transpose(1, 2).contiguous()


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """x fp32 rounded to bfloat16 by dropping its low 16 bits."""
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32)


def refused_here() -> bool:
    """On a CPU without AVX-512 BF16: checks that bf16 products are refused, naming what is missing, and says
    so (a test then ends: the kernels cannot run here, and a skip would fail under CI=true)."""
    if supported():
        return False
    with pytest.raises(K3Error, match="AVX-512 BF16"):
        bf16_model(None).tile_weights(bf16_products=True)
    with pytest.raises(RuntimeError, match="AVX-512 BF16"):
        NATIVE.pair_rows(torch.zeros(16, 16, dtype=torch.bfloat16))
    return True


def test_the_paired_kernel_sums_the_rounded_vectors_products_in_fp32():
    """48 rows (3 blocks; 2 threads cut the middle one in two) x K = 520 (a vector's last 8 values past the
    rounding's 16-lane body), 1-11 vectors, 1 and 2 threads."""
    if refused_here():
        return
    g = gen(7)
    N, K = 48, 520
    w = torch.randn(N, K, generator=g).bfloat16()
    paired = NATIVE.pair_rows(w)
    assert torch.equal(paired, by_torch(w)) and is_paired(paired) and matrix_shape(paired) == (N, K)
    assert torch.equal(rows_of(paired, 16, 48), w[16:]) and torch.equal(rows_of(paired, 0, N), w)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for B in range(1, 12):
                x = torch.randn(B, K, generator=g) * torch.logspace(-3, 3, K)  # values over many binades
                y = NATIVE.dense_rows_product(x, paired).double()
                nearest = x.bfloat16().double() @ w.double().T
                truncated = toward_zero(x).double() @ w.double().T
                scale = x.bfloat16().double().abs() @ w.double().abs().T
                error = (y - nearest).abs()
                assert (error <= K * 2.0**-24 * scale).all(), (threads, B)  # fp32 sums of exact products
                assert error.max() < 0.01 * (truncated - nearest).abs().max(), (threads, B)
                alone = [NATIVE.dense_rows_product(x[b : b + 1].contiguous(), paired) for b in range(B)]
                assert torch.equal(torch.cat(alone).double(), y), (threads, B)
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def decode_steps(model, which: list[int], steps: int = 3) -> list[torch.Tensor]:
    """Decode steps' logits [len(which), 1, V] of the sequences `which` of three fixed ones (prompts of 70, 5
    and 12 tokens, then fixed tokens), prefilled one by one and decoded as one batch."""
    vocab, caches = model.config.vocab_size, []
    for i in which:
        caches.append(model.new_cache(1))
        model(torch.randint(0, vocab, (1, (70, 5, 12)[i]), generator=gen(i)), caches[-1])
    cache = type(caches[0]).stack(caches)
    tokens = torch.randint(0, vocab, (3, steps), generator=gen(99))[which]  # [len(which), steps]
    return [model(tokens[:, t : t + 1], cache) for t in range(steps)]


def test_a_paired_model_decodes_near_the_exact_one_and_each_sequence_alone_or_batched():
    if refused_here():
        return
    model = bf16_model(None).set_fast_decode(True)
    paired = copy.deepcopy(model)
    done = paired.tile_weights(bf16_products=True)
    assert is_paired(paired.lm_head.weight) and is_paired(paired.model.layers[0].self_attn.q_proj.weight)
    assert not is_tiled(paired.model.layers[3].self_attn.kv_b_proj.weight)  # read in place, head by head
    assert done == sum(p.nbytes for p in paired.parameters() if is_tiled(p)) > 0
    exact, near = logits(model, [70, 5, 12], 3), logits(paired, [70, 5, 12], 3)
    assert torch.equal(exact[0], near[0])  # 70 tokens: converted blocks and torch's GEMM, exact
    for a, b in zip(exact[1:], near[1:], strict=True):
        distance = (a - b).abs().max() / a.abs().max()
        assert 0 < distance < 0.02  # the products changed, a little
    batched = decode_steps(paired, [0, 1, 2])
    for b in range(3):  # the batch's row b is sequence b's steps alone, bit for bit
        for step, one in enumerate(decode_steps(paired, [b])):
            assert torch.equal(batched[step][b], one[0]), (step, b)


def test_a_paired_state_dict_is_the_rows_and_bad_requests():
    if refused_here():
        return
    model = bf16_model(None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.tile_weights(bf16_products=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert model.untile_weights() > 0 and not any(is_tiled(p) for p in model.parameters())
    with pytest.raises(RuntimeError, match="multiple of 16"):
        NATIVE.pair_rows(torch.zeros(8, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="blocks of 16"):
        rows_of(by_torch(torch.zeros(32, 16, dtype=torch.bfloat16)), 8, 32)
