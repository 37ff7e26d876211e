"""The fused decode step (k3.model.fused: each mixer and FFN of a layer in one native call, k3.ops.decode)
equals the general path.

References: the model's own modules run the general way (torch ops: KDAttention / MLAttention forward with
a cache, the MoE's sorted dispatch, MLP, attn_res_read, F.linear), the whole model with
`set_fast_decode(False)`, and transformers' Kimi Linear through it (tests/model/test_kimi_linear_parity.py
ties k3 to it). Counters on the native module show that the fused kernels really ran (a silent fallback
to the general path would pass every equality). 1e-5 relative to the largest value.
"""

from __future__ import annotations

import dataclasses
import os
import select

import pytest
import torch
from decode_steps import prefilled, with_bf16_weights
from kimi_linear_oracle import tiny_kimi_linear
from native_counting import Counting

import k3.model.attn_res as attn_res_module
import k3.model.fused as fused
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.attn_res import attn_res_read, attn_res_read_native
from k3.model.cache import ModelCache
from k3.model.routing import record_routing
from k3.ops.decode.native import load_native

needs_native = pytest.mark.skipif(
    load_native() is None and os.environ.get("CI") != "true", reason="native kernels unavailable (k3 doctor)"
)
pytestmark = needs_native


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def counting(monkeypatch) -> Counting:
    """The native module, counting its calls, on the layer-by-layer route (each mixer and FFN its own call:
    the one-call route runs these kernels from inside `decoder_layers`, where no counter sees them, and is
    tied to this route bit for bit in tests/model/test_decoder_layers.py)."""
    counter = Counting(load_native())
    monkeypatch.setattr(fused, "decoder_layers", lambda *args: None)
    monkeypatch.setattr(fused, "load_native", lambda: counter)
    monkeypatch.setattr(attn_res_module, "load_native", lambda: counter)
    return counter


@torch.no_grad()
def decode(model: K3ForCausalLM, cache: ModelCache, token: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy-free decode: the logits of `steps` steps fed fixed tokens (token + step)."""
    out = [model(token + t, cache) for t in range(steps)]
    return torch.cat(out, dim=1)  # [B, steps, V]


def fused_vs_general(model: K3ForCausalLM, lengths: list[int], steps: int = 4) -> tuple[float, float]:
    cache, token = prefilled(model, lengths, seed=7)
    general_cache, _ = prefilled(model, lengths, seed=7)
    fast = decode(model.set_fast_decode(True), cache, token, steps)
    general = decode(model.set_fast_decode(False), general_cache, token, steps)
    model.set_fast_decode(True)
    return rel(fast, general), general.abs().max().item()


@pytest.mark.parametrize(
    "preset,quantized,lengths",
    [("tiny", None, [9]), ("tiny", False, [5, 12, 3]), ("mini", None, [5, 12, 3])],  # None: MXFP4 experts
)
def test_fused_step_equals_general_path(counting, preset, quantized, lengths):
    cfg = K3Config.preset(preset)
    layers = None if preset == "tiny" else 5  # mini: KDA, MLA at 3, a dense and MoE FFNs, an AttnRes block
    model = K3ForCausalLM.from_config(cfg, seed=3, quantized_experts=quantized, num_layers=layers)
    error, scale = fused_vs_general(model, lengths)
    assert error <= 1e-5 and scale > 0.1
    n = model.num_layers
    kda = sum(1 for layer in model.model.layers if layer.self_attn.__class__.__name__ == "KDAttention")
    moe = sum(1 for layer in model.model.layers if layer.is_moe)
    per_step = {"kda_mixer": kda, "mla_mixer": n - kda, "moe_route": moe, "moe_experts": moe}
    per_step |= {"mlp": n - moe, "project": 1}
    steps = 4
    assert {name: counting.calls[name] for name in per_step} == {k: v * steps for k, v in per_step.items()}
    assert counting.calls["attn_res_read"] > 0  # K3's AttnRes reads, natively too


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_a_rows_fused_step_does_not_depend_on_its_batch(counting, weights):
    """The engine decodes whoever is waiting together: a sequence's logits must be the same bits in a batch
    of three as alone (every kernel sums a row's products in one order whatever the batch: the dense tiles,
    the MXFP4 one-row and few-row GEMVs, including their AVX-512 variant where the CPU has one)."""
    model = K3ForCausalLM.from_config(K3Config.preset("mini"), seed=3, num_layers=5)
    if weights == "bf16":
        model = with_bf16_weights(model)
    lengths = [5, 12, 3]
    cache, token = prefilled(model, lengths, seed=7)
    together = decode(model, cache, token, steps=3)
    for i, n in enumerate(lengths):
        alone_cache, _ = prefilled(model, [n], seed=7 + i)
        alone = decode(model, alone_cache, token[i : i + 1], steps=3)
        assert torch.equal(together[i], alone[0]), f"row {i}: max diff {(together[i] - alone[0]).abs().max()}"
    assert counting.calls["moe_experts"] > 0 and counting.calls["kda_mixer"] > 0  # the fused path ran


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_the_fused_step_gives_the_same_bits_at_1_and_2_threads(weights):
    """Every output of the fused kernels is summed inside one thread (rows and experts are split between
    threads, never a sum): a batch's decode steps from the same cache give the same bits at 1 and 2
    threads. The prefills run at one thread count (torch's GEMMs there are only bounded across counts)."""
    model = K3ForCausalLM.from_config(K3Config.preset("mini"), seed=3, num_layers=5)
    if weights == "bf16":
        model = with_bf16_weights(model)
    before = torch.get_num_threads()
    steps = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(1)
            cache, token = prefilled(model, [5, 12, 3], seed=7)
            torch.set_num_threads(threads)
            steps[threads] = decode(model, cache, token, steps=3)
    finally:
        torch.set_num_threads(before)
    assert steps[1].abs().max() > 0.1 and torch.equal(steps[1], steps[2])


def test_mla_head_groups_over_cache_tiles_equal_the_general_path(counting):
    """MLA decode goes over a sequence's cache a tile of 128 positions at a time for every head group of the
    chunk of heads a thread takes (k3/ops/decode/_native_mixers.h, `attend`). 20 heads (groups of 8, 8 and 4)
    over caches of 300 and 170 positions (three and two tiles, the last ones partial): against the general
    path (torch ops); bit for bit each sequence alone against the batch, and at 1 against 2 threads, where the
    chunks are others (at 2: 16 heads, then 4 of one sequence and 12 of the next, then 8)."""
    cfg = dataclasses.replace(K3Config.preset("mini"), num_attention_heads=20, num_key_value_heads=20)
    model = K3ForCausalLM.from_config(cfg, seed=3, num_layers=4)  # KDA, KDA, KDA, MLA
    lengths = [300, 170]
    error, scale = fused_vs_general(model, lengths, steps=2)
    assert error <= 1e-5 and scale > 0.1
    assert counting.calls["mla_mixer"] == 2
    before = torch.get_num_threads()
    steps = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(1)  # the prefills alike (torch's GEMMs are only bounded across counts)
            cache, token = prefilled(model, lengths, seed=7)
            alone = [prefilled(model, [n], seed=7 + i)[0] for i, n in enumerate(lengths)]
            torch.set_num_threads(threads)
            steps[threads] = decode(model, cache, token, steps=2)
            for i, one in enumerate(alone):
                assert torch.equal(decode(model, one, token[i : i + 1], steps=2)[0], steps[threads][i]), (
                    threads,
                    i,
                )
    finally:
        torch.set_num_threads(before)
    assert torch.equal(steps[1], steps[2])


def test_the_experts_avx512_and_avx2_gemvs_give_the_same_bits(monkeypatch):
    """One sequence's MXFP4 experts (one-row GEMVs: AVX-512 where the CPU has it) against the same step
    with the AVX2 kernel forced: the same logits, bit for bit. On an AVX2-only CPU both runs are AVX2."""
    native = load_native()
    model = K3ForCausalLM.from_config(K3Config.preset("mini"), seed=3, num_layers=5)
    steps = {}
    for variant in ("auto", "avx2"):

        class Forced:
            def __getattr__(self, name, variant=variant):
                call = getattr(native, name)
                return (lambda *a, **k: call(*a, **k, variant=variant)) if name == "moe_experts" else call

        monkeypatch.setattr(fused, "load_native", Forced)
        cache, token = prefilled(model, [9], seed=5)
        steps[variant] = decode(model, cache, token, steps=3)
    assert steps["auto"].abs().max() > 0.1 and torch.equal(steps["auto"], steps["avx2"])
    assert native.gemv_variant() in ("avx512", "avx2")


# K3's latent and expert widths, an odd block count (7, and 21: whole groups of 8 pairs, 2 pairs more and the
# odd block), one block
@pytest.mark.parametrize("K", [3584, 3072, 32 * 7, 32 * 21, 32])
def test_the_experts_row_kernel_against_float64_avx2_and_its_batch(K):
    """The decode step's per-expert product (`expert_rows`: the nibble-order kernel, in 16 lanes where the
    CPU has AVX-512) against the AVX2 kernel forced (bit for bit), against float64 of the
    decoded weights (fp32 rounding), and each row alone against the same row in batches of 2, 5, 8 and 11
    (bit for bit: the few-row kernel at 2, 5 and 8 rows, and two passes of 8 rows and 3); every normal scale
    byte appears (1: the subnormal 2^-127), and 0 (2^-128) and 255 (NaN) in a row each."""
    from k3.ops.mxfp4 import dequantize_mxfp4

    native = load_native()
    g = gen(K)
    rows = 254
    packed = torch.randint(0, 256, (rows, K // 2), dtype=torch.uint8, generator=g)
    scale = (torch.arange(rows * (K // 32)).view(rows, K // 32) % 254 + 1).to(torch.uint8)
    lead = min(4, K // 32)  # a trained expert's range first, so that most outputs stay finite
    scale[:, :lead] = torch.randint(118, 130, (rows, lead), dtype=torch.uint8, generator=g)
    scale[3, -1], scale[4, -1] = 0, 255
    w = dequantize_mxfp4(packed, scale).double()  # [rows, K]
    x = torch.randn(11, K, generator=g)

    def bits(t: torch.Tensor) -> torch.Tensor:  # the largest scales overflow to inf and NaN: compare bits
        return t.view(torch.int32)

    def one_by_one(variant: str) -> torch.Tensor:
        return torch.cat([native.expert_rows(row[None], packed, scale, variant=variant) for row in x])

    alone = one_by_one("auto")
    assert torch.equal(bits(alone), bits(one_by_one("avx2")))
    for B in (2, 5, 8, 11):
        batch = native.expert_rows(x[:B], packed, scale)
        assert torch.equal(bits(batch), bits(native.expert_rows(x[:B], packed, scale, variant="avx2"))), B
        assert torch.equal(bits(batch), bits(alone[:B])), B
    exact = x.double() @ w.T
    finite = exact.abs() < 1e30  # compare with float64 where fp32 can hold the products
    tolerance = 1e-6 * (x.double().abs() @ w.abs().T)
    assert finite.float().mean() > 0.3
    assert ((batch.double() - exact).abs()[finite] <= tolerance[finite]).all()


def test_the_experts_row_kernel_keeps_tiny_inputs_exact():
    """Inputs far below 1 (SiTU's outputs for very negative gates reach 1e-31 and less) are multiplied as they
    are: within fp32 rounding of float64 at magnitudes from 2^-96 down to 2^-120, alone and in a batch, AVX2
    and AVX-512 alike. The kernel once laid x out times 2^-24, which made every |x| < 2^-102 subnormal (fewer
    bits, and a slow FMA on AMD Zen 3): at 2^-110 and below its products lost 2^-16 of their size and more,
    outside this tolerance."""
    from k3.ops.mxfp4 import dequantize_mxfp4

    native = load_native()
    g = gen(31)
    rows, K = 64, 3584
    packed = torch.randint(0, 256, (rows, K // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(118, 130, (rows, K // 32), dtype=torch.uint8, generator=g)  # a trained expert's
    w = dequantize_mxfp4(packed, scale).double()  # [rows, K]
    sign = torch.randint(0, 2, (9, K), generator=g).double() * 2 - 1
    exponent = torch.arange(96, 123, 3).double().view(9, 1)
    magnitude = (1 + torch.rand(9, K, generator=g).double()) * 2.0**-exponent
    x = (sign * magnitude).float()  # [9, K]: row i in [2^-(96 + 3i), 2^-(95 + 3i)) in size
    assert (x.abs() >= 2.0**-126).all()  # normal inputs (and outputs): fp32 keeps 24 bits of each
    batch = native.expert_rows(x, packed, scale)
    assert torch.equal(batch, native.expert_rows(x, packed, scale, variant="avx2"))
    alone = torch.cat([native.expert_rows(row[None], packed, scale) for row in x])
    assert torch.equal(batch, alone)
    exact = x.double() @ w.T
    tolerance = 1e-6 * (x.double().abs() @ w.abs().T)
    assert (exact != 0).all() and ((batch.double() - exact).abs() <= tolerance).all()


@pytest.mark.parametrize("K", [7168 + 5, 256 + 5, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_dense_rows_against_float64_avx2_and_one_row(dtype, K):
    """The decode step's dense products (`dense_rows_product`: at B > 1 the 16-lane tiles, two vectors per
    register, where the CPU has AVX-512) against the 8-lane tiles forced (bit for bit), each row against the
    same vector alone (bit for bit: batch-invariant), at 1 and 2 threads (bit for bit: a row is summed in one
    thread) and against float64 (fp32 rounding). K has a tail of 5 beyond the 8-lane body, at K3's width and
    at short ones (one vector's tiles then ask for the next tile's block: kShortTileBytes; or, on Zen 3, read
    fp32 rows one at a time for up to 12 vectors: both orders are forced here on every CPU, alone and in
    batches); 37 rows leave a short tile; the batch sizes reach every pair tile and odd ones."""
    native = load_native()
    g = gen(11)
    N = 37
    w = torch.randn(N, K, generator=g).to(dtype)
    x = torch.randn(13, K, generator=g)
    alone = torch.cat([native.dense_rows_product(x[b : b + 1], w) for b in range(13)])
    exact = x.double() @ w.double().T
    assert ((alone.double() - exact).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T)).all()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for order in ("tiles", "one_by_one"):
                one = [native.dense_rows_product(x[b : b + 1], w, short_rows=order) for b in range(13)]
                assert torch.equal(torch.cat(one), alone), (threads, order)
                for B in (2, 5, 8, 12, 13):  # one by one up to 12 vectors (kRowByRowVectors)
                    batch = native.dense_rows_product(x[:B], w, short_rows=order)
                    assert torch.equal(batch, alone[:B]), (threads, order, B)
            for B in (2, 3, 4, 5, 8, 9, 13):
                batch = native.dense_rows_product(x[:B], w)
                assert torch.equal(batch, native.dense_rows_product(x[:B], w, variant="avx2")), (threads, B)
                assert torch.equal(batch, alone[:B]), (threads, B)
    finally:
        torch.set_num_threads(before)


def test_projections_split_in_chunks_cover_every_row_once():
    """`project` hands its matrices' rows to the threads in chunks they take as they go
    (k3_native::parallel_chunks): at K = 64 a chunk is a multiple of 512 rows, so three matrices of 1,
    9,000 and 31,000 rows make eight chunks whose edges fall inside matrices, and 700 rows make one a
    thread. Every row at 1, 2 and 3 threads has the bits of 1 thread (each row summed in one call, whoever
    runs it) and is within fp32 rounding of float64; a row no chunk covered would be uninitialised memory."""
    native = load_native()
    g = gen(13)
    x = torch.randn(3, 64, generator=g)
    before = torch.get_num_threads()
    for sizes in ((1, 9_000, 31_000), (700,)):
        ws = [torch.randn(n, 64, generator=g) for n in sizes]
        try:
            torch.set_num_threads(1)
            alone = native.project(x, None, 0.0, ws)
            for threads in (2, 3):
                torch.set_num_threads(threads)
                split = native.project(x, None, 0.0, ws)
                assert all(torch.equal(a, b) for a, b in zip(alone, split, strict=True)), (sizes, threads)
        finally:
            torch.set_num_threads(before)
        for w, y in zip(ws, alone, strict=True):
            bound = 1e-6 * (x.double().abs() @ w.double().abs().T)
            assert ((y.double() - x.double() @ w.double().T).abs() <= bound).all(), sizes


@pytest.mark.parametrize("shared_width", [200, 40, None])  # 13 pieces of rows beside 5 experts, 3, none
def test_the_experts_and_shared_rows_in_one_region(shared_width):
    """moe_experts runs the routed experts and the shared experts' gate and up rows as tasks of one region
    (each expert followed by its share of the row pieces; at D = 1,024 a piece is 32 rows), then the
    up-projection and the shared down rows in one more. Against float64 (fp32 rounding) and at 1, 2 and 3
    threads bit for bit: a task never run leaves its rows' products at zero, far from float64's."""
    native = load_native()
    g = gen(15)
    B, k, L, m, D = 2, 3, 48, 24, 1024
    experts = [
        [
            torch.randn(m, L, generator=g) / 7,
            torch.randn(m, L, generator=g) / 7,
            torch.randn(L, m, generator=g) / 5,
        ]
        for _ in range(5)
    ]
    slots = [0, 1, 2, 3, 4, 1]  # [B, k]: five distinct experts, one chosen twice
    mixing = torch.rand(B, k, generator=g)
    xn, z = torch.randn(B, D, generator=g), torch.randn(B, L, generator=g)
    norm_w, w_up = torch.rand(L, generator=g) + 0.5, torch.randn(D, L, generator=g) / 7
    shared = (
        [
            torch.randn(shared_width, D, generator=g) / 32,
            torch.randn(shared_width, D, generator=g) / 32,
            torch.randn(D, shared_width, generator=g) / 15,
        ]
        if shared_width
        else [None, None, None]
    )

    def run() -> torch.Tensor:
        dense = [w for e in experts for w in e]
        return native.moe_experts(
            xn, z, mixing, slots, dense, [], [], 0, 1.0, 1.0, norm_w, 1e-6, w_up, *shared, "auto", False
        )

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run()
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(run(), alone), threads
    finally:
        torch.set_num_threads(before)

    def glu(x, gate, up, down):  # SiLU(x gate^T) * (x up^T), then down
        return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    mixed = torch.zeros(B, L, dtype=torch.float64)
    for r in range(B):
        for j in range(k):
            e = [w.double() for w in experts[slots[r * k + j]]]
            mixed[r] += mixing[r, j].double() * glu(z[r].double(), *e)
    mixed = mixed / (mixed.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * norm_w.double()
    want = mixed @ w_up.double().T
    if shared_width:
        want = want + glu(xn.double(), *(w.double() for w in shared))
    assert alone.abs().max() > 0.1 and rel(alone.double(), want) <= 1e-5


def test_the_chunk_pool_after_a_fork():
    """parallel_chunks runs on its own workers (k3/ops/_native_pool.h), threads that a forked child does not
    have (it makes a pool of its own). A child forked after the parent's pool ran projections of eight
    chunks at 2 threads runs 50 of them: every result has the bits of one thread's, and it finishes. (The
    child compares bytes, not tensors: torch's own parallel ops hang in a child forked after OpenMP
    regions, libgomp's limit.)"""
    native = load_native()
    g = gen(14)
    x = torch.randn(2, 64, generator=g)
    ws = [torch.randn(n, 64, generator=g) for n in (9_000, 31_000)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [y.numpy().tobytes() for y in native.project(x, None, 0.0, ws)]
        torch.set_num_threads(2)

        def same_bits(runs: int) -> bool:
            return all(
                [y.numpy().tobytes() for y in native.project(x, None, 0.0, ws)] == alone for _ in range(runs)
            )

        assert same_bits(20)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # the child: its answer is one byte; it never returns into pytest
            try:
                os.write(write, b"1" if same_bits(50) else b"0")
            finally:
                os._exit(0)
        os.close(write)
        try:
            answered, _, _ = select.select([read], [], [], 120)
            if not answered:
                os.kill(child, 9)
            assert answered, "the forked child did not finish its projections in 120 s"
            assert os.read(read, 1) == b"1"
        finally:
            os.close(read)
            status = os.waitpid(child, 0)[1]
        assert status == 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("L", [512, 32 + 8 + 3])
def test_the_mla_weighted_rows_against_float64_avx2_and_one_head(L):
    """MLA decode sums each head's softmax weights times the cached latents for up to 8 heads at once
    (`weighted_rows_product`: 32-column blocks in 16 lanes where the CPU has AVX-512, 8-column blocks, then
    the columns left over one at a time). Against float64 (fp32 rounding), the 8-lane blocks forced (bit
    for bit) and each head alone (bit for bit: a head's sums do not depend on its group). L = 43 reaches
    the three kinds of columns; 150 positions span three tiles of 64."""
    native = load_native()
    g = gen(12)
    S = 150
    a = torch.softmax(torch.randn(8, S, generator=g), dim=-1)
    c = torch.randn(S, L, generator=g)
    group = native.weighted_rows_product(a, c)
    exact = a.double() @ c.double()
    assert ((group.double() - exact).abs() <= 1e-6 * (a.double() @ c.double().abs())).all()
    assert torch.equal(group, native.weighted_rows_product(a, c, variant="avx2"))
    for G in range(1, 9):
        assert torch.equal(native.weighted_rows_product(a[:G].contiguous(), c), group[:G]), G
    alone = torch.cat([native.weighted_rows_product(a[j : j + 1].contiguous(), c) for j in range(8)])
    assert torch.equal(alone, group)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        native.weighted_rows_product(torch.ones(9, S), c)


def test_an_mla_head_with_a_nan_score_gives_nan_and_leaves_the_other_sequence_alone(counting):
    """The MLA heads' softmax runs 8 positions at a time (exp8, the tail padded with -inf): a NaN in one
    sequence's cached k_rope (it enters the scores only, not the weighted sum of latents) makes that
    sequence's update NaN, as the general path's softmax does, and the other sequence of the batch keeps
    the general path's values."""
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=11).set_fast_decode(False)
    index, layer = next(
        (i, candidate)
        for i, candidate in enumerate(model.model.layers)
        if candidate.self_attn.__class__.__name__ == "MLAttention"
    )
    cache, _ = prefilled(model, [7, 3], seed=1)
    reference, _ = prefilled(model, [7, 3], seed=1)
    for state in (cache.layers[index], reference.layers[index]):
        state.k_rope[0, 2, 1] = float("nan")  # within sequence 0's 7 positions
    x = torch.randn(2, 1, model.config.hidden_size, generator=gen(4))
    with torch.no_grad():
        got = fused.mixer_update(layer.input_layernorm, layer.self_attn, x, cache.layers[index])
        want = layer.self_attn(layer.input_layernorm(x), reference.layers[index])
    assert counting.calls["mla_mixer"] == 1
    assert got[0].isnan().all() and want[0].isnan().all()
    assert got[1].isfinite().all() and rel(got[1], want[1]) <= 1e-5


@pytest.mark.parametrize("quantized", [None, False])  # routed experts MXFP4, or BF16 like the rest
def test_fused_step_with_bf16_weights_equals_general_path(counting, quantized):
    cfg = K3Config.preset("tiny")
    model = with_bf16_weights(K3ForCausalLM.from_config(cfg, seed=4, quantized_experts=quantized))
    assert model.lm_head.weight.dtype == torch.bfloat16
    error, scale = fused_vs_general(model, [6, 10])
    assert error <= 1e-5 and scale > 0.1
    n, moe = model.num_layers, sum(1 for layer in model.model.layers if layer.is_moe)
    assert counting.calls["kda_mixer"] + counting.calls["mla_mixer"] == n * 4  # every mixer fused
    assert counting.calls["moe_experts"] == moe * 4 and counting.calls["mlp"] == (n - moe) * 4
    assert counting.calls["project"] == 4 and counting.calls["attn_res_read"] > 0


@pytest.mark.parametrize("lengths", [[9], [5, 12, 3]])  # one sequence: the general path's dispatch_one
def test_fused_step_with_int8_expert_inputs_equals_general_path(counting, lengths):
    """set_int8_expert_inputs: the fused MoE rounds the experts' inputs as the general path's modules do
    (k3.ops.mxfp4.int8_x; had it stayed exact, the two would part by the rounding), away from exact logits."""
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=3)
    cache, token = prefilled(model, lengths, seed=7)
    exact = decode(model, cache, token, steps=4)
    model.set_int8_expert_inputs(True)
    fused_before = counting.calls["moe_experts"]
    error, scale = fused_vs_general(model, lengths)
    assert error <= 1e-5 and scale > 0.1
    moe = sum(1 for layer in model.model.layers if layer.is_moe)
    assert counting.calls["moe_experts"] - fused_before == 4 * moe
    cache, token = prefilled(model, lengths, seed=7)
    assert rel(decode(model, cache, token, steps=4), exact) > 1e-4


@pytest.mark.parametrize("q_lora_rank,n_group", [(None, 1), (16, 2)])
def test_fused_step_on_kimi_linear(tmp_path, counting, q_lora_rank, n_group):
    """Kimi Linear: softplus gate, low-rank output gate, plain experts of the hidden state, no AttnRes, v
    head 12 != qk head 24, grouped routing; loaded from transformers' save_pretrained."""
    tiny_kimi_linear(q_lora_rank, n_group).save_pretrained(tmp_path)
    model = K3ForCausalLM.from_pretrained(tmp_path)
    error, scale = fused_vs_general(model, [10, 4])
    assert error <= 1e-5 and scale > 0.1
    assert counting.calls["kda_mixer"] == 3 * 4 and counting.calls["mla_mixer"] == 2 * 4
    assert counting.calls["moe_experts"] == 4 * 4 and counting.calls["attn_res_read"] == 0


def test_grouped_routing_and_a_non_default_l2_eps(counting):
    cfg = dataclasses.replace(K3Config.preset("tiny"), num_expert_group=4, topk_group=2, kda_l2norm_eps=1e-2)
    model = K3ForCausalLM.from_config(cfg, seed=5, quantized_experts=False)
    error, _ = fused_vs_general(model, [6, 11])
    assert error <= 1e-5
    assert counting.calls["moe_route"] > 0 and counting.calls["kda_mixer"] > 0


def test_fused_kernels_each_equal_their_module(counting):
    """Layer by layer on one decode step: each fused update against the module's own general forward."""
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM.from_config(cfg, seed=11).set_fast_decode(False)
    cache, _ = prefilled(model, [7, 3], seed=1)
    reference, _ = prefilled(model, [7, 3], seed=1)
    x = torch.randn(2, 1, cfg.hidden_size, generator=gen(2))
    with torch.no_grad():
        for layer, state, ref_state in zip(model.model.layers, cache.layers, reference.layers, strict=True):
            got = fused.mixer_update(layer.input_layernorm, layer.self_attn, x, state)
            want = layer.self_attn(layer.input_layernorm(x), ref_state)
            assert got is not None and rel(got, want) <= 1e-5
            got = fused.ffn_update(layer.post_attention_layernorm, layer.ffn, x)
            want = layer.ffn(layer.post_attention_layernorm(x))
            assert got is not None and rel(got, want) <= 1e-5
        for fused_state, ref_state in zip(
            cache.layers, reference.layers, strict=True
        ):  # states advanced alike
            if hasattr(ref_state, "lengths"):
                assert torch.equal(fused_state.lengths, ref_state.lengths)
                n = int(ref_state.lengths.max())
                assert rel(fused_state.latent[:, :n], ref_state.latent[:, :n]) <= 1e-5
                assert rel(fused_state.k_rope[:, :n], ref_state.k_rope[:, :n]) <= 1e-5
            else:
                assert rel(fused_state.recurrent, ref_state.recurrent) <= 1e-5
                assert rel(fused_state.conv_v, ref_state.conv_v) <= 1e-5  # the last one: this step's v_proj
        values = [torch.randn(2, 1, cfg.hidden_size, generator=gen(i)) for i in range(3)]
        norm, proj = (
            model.model.layers[2].self_attention_res_norm,
            model.model.layers[2].self_attention_res_proj,
        )
        assert rel(attn_res_read_native(values, norm, proj), attn_res_read(values, norm, proj)) <= 1e-5
        logits = fused.lm_head_logits(model.lm_head, x)
        assert logits is not None and rel(logits, torch.nn.functional.linear(x, model.lm_head.weight)) <= 1e-5


def test_general_path_with_gradients_or_recorded_routing(counting):
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=0, quantized_experts=False)
    cache, token = prefilled(model, [5], seed=3)
    model(token, cache)  # grad enabled: no native call at all (the kernels have no backward)
    assert sum(counting.calls.values()) == 0
    with torch.no_grad(), record_routing(model) as trace:
        model(token, cache)
    assert counting.calls["moe_route"] == 0 and counting.calls["kda_mixer"] > 0  # routers' hooks: general MoE
    assert all(trace.calls(layer) == 1 for layer in trace.layers)


def test_a_dispatch_replaced_on_the_instance_is_used(counting):
    """k3.dist's expert parallelism replaces `MoE.dispatch` on the instance: the fused MoE must use it."""
    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=0)
    cache, token = prefilled(model, [5], seed=3)
    seen = []
    for layer in model.model.layers:
        if layer.is_moe:
            moe = layer.block_sparse_moe
            object.__setattr__(moe, "dispatch", lambda *a, _d=moe.dispatch: seen.append(1) or _d(*a))
    with torch.no_grad():
        model(token, cache)
    assert len(seen) == sum(layer.is_moe for layer in model.model.layers)
    assert counting.calls["moe_route"] == 0 and counting.calls["kda_mixer"] > 0
