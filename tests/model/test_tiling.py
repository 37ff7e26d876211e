"""BF16 weights tiled for the decode kernels (k3.model.tiling) give the untiled model's logits bit for bit.

References: the same model untiled (its kernels read [N, K] rows; tests/model/test_fused_decode.py ties
those to the general path and to float64), the layout written out by torch ops (view + transpose), and
autograd through the untiled weight. Counters on the native module show the tiled kernels ran.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.norm import Linear
from k3.model.tiling import is_tiled, matrix_shape, rows_of, tile_weights, untile_weights
from k3.ops.decode.native import load_native

pytestmark = pytest.mark.skipif(
    load_native() is None and os.environ.get("CI") != "true", reason="native kernels unavailable (k3 doctor)"
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def by_torch(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] in the tiled layout written out from its definition: [N/8, K/8, 8 rows, 8 columns]."""
    N, K = w.shape
    return w.view(N // 8, 8, K // 8, 8).transpose(1, 2).contiguous()


def bf16_model(quantized: bool | None) -> K3ForCausalLM:
    """mini's first 5 layers (KDA, MLA at 3, a dense and MoE FFNs), every floating weight BF16; routed
    experts MXFP4 (None) or BF16 (False)."""
    cfg = K3Config.preset("mini")
    model = K3ForCausalLM.from_config(cfg, seed=5, quantized_experts=quantized, num_layers=5)
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.bfloat16()
    return model.requires_grad_(False)  # as from_pretrained loads it for inference


@torch.no_grad()
def logits(model: K3ForCausalLM, lengths: list[int], steps: int) -> list[torch.Tensor]:
    """Each prompt's prefill logits (prompts longer than 64 tokens go through converted blocks and torch's
    GEMM, shorter ones through the native kernels), then `steps` decode steps of the batch."""
    vocab, out, caches = model.config.vocab_size, [], []
    for i, n in enumerate(lengths):
        caches.append(model.new_cache(1))
        out.append(model(torch.randint(0, vocab, (1, n), generator=gen(i)), caches[-1]))
    cache = type(caches[0]).stack(caches)
    token = torch.randint(0, vocab, (len(lengths), 1), generator=gen(99))
    out += [model(token + t, cache) for t in range(steps)]
    return out


@pytest.mark.parametrize("quantized", [None, False])
@pytest.mark.parametrize("fast", [True, False])  # the fused decode step, or the general path's modules
def test_a_tiled_model_gives_the_untiled_logits_bit_for_bit(quantized, fast):
    model = bf16_model(quantized).set_fast_decode(fast)
    tiled = copy.deepcopy(model)
    done = tiled.tile_weights()
    matrices = {n: p for n, p in tiled.named_parameters() if n.endswith("proj.weight") or ".w" in n}
    assert done == sum(p.nbytes for p in matrices.values() if is_tiled(p)) > 0
    assert is_tiled(tiled.lm_head.weight) and is_tiled(tiled.model.layers[0].self_attn.q_proj.weight)
    assert not is_tiled(tiled.model.layers[3].self_attn.kv_b_proj.weight)  # read in place, head by head
    if quantized is False:
        assert is_tiled(tiled.model.layers[1].block_sparse_moe.experts[0].w1.weight)
    before, after = logits(model, [70, 5, 12], 3), logits(tiled, [70, 5, 12], 3)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_the_tiled_kernels_equal_the_row_kernels_and_the_layout():
    """dense_rows_product on a tiled matrix against the same matrix in rows (bit for bit) at batch sizes
    1-9, 1 and 2 threads, both widths: 40 rows split across 2 threads cut a block in two (rows 16-23),
    which the one-vector 16-lane kernel does row by row; one vector in AVX2 reads two whole blocks at a time
    (rows 0-15 and 24-39 on 2 threads, a pair and a block left over on 1). Several vectors in AVX2 go
    through a block 256 columns at a time: K = 1000 ends in a shorter chunk."""
    native = load_native()
    g = gen(3)
    variants = ["avx2"] + (["avx512"] if native.gemv_variant() == "avx512" else [])
    before = torch.get_num_threads()
    try:
        for K in (7168, 1000):
            w = torch.randn(40, K, generator=g).bfloat16()
            tiled = native.tile_rows(w)
            assert torch.equal(tiled, by_torch(w)) and matrix_shape(tiled) == (40, K)
            assert torch.equal(rows_of(tiled, 8, 24), w[8:24]) and torch.equal(rows_of(tiled, 0, 40), w)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for B in range(1, 10):
                    x = torch.randn(B, K, generator=g)
                    for variant in variants:
                        rows = native.dense_rows_product(x, w, variant=variant)
                        blocks = native.dense_rows_product(x, tiled, variant=variant)
                        assert torch.equal(blocks, rows), (K, B, variant)
    finally:
        torch.set_num_threads(before)


def advised_huge(address: int) -> bool:
    """Whether the mapping holding `address` is advised to use huge pages (its VmFlags in smaps say `hg`)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False


def test_fp32_matrices_move_together_onto_huge_pages_with_the_same_logits(tmp_path):
    """Every fp32 Linear weight of an inference model is copied onto pages advised huge (smaps): its values
    and rows kept, each a tensor with a storage of its own (a state_dict saves as it did), and the logits
    stay bit for bit."""
    model = K3ForCausalLM.from_config(K3Config.preset("mini"), seed=3, num_layers=5).requires_grad_(False)
    placed = copy.deepcopy(model)
    linears = {f"{n}.weight": m.weight for n, m in placed.named_modules() if isinstance(m, Linear)}
    assert placed.tile_weights() == sum(w.nbytes for w in linears.values())
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()  # MADV_HUGEPAGE needs the kernel's THP
    storages = set()
    for name, before in linears.items():
        after = placed.get_parameter(name)
        assert after is not before and not is_tiled(after) and torch.equal(after, before)
        assert after.data_ptr() % 64 == 0
        storages.add(after.untyped_storage().data_ptr())
        assert advised_huge(after.data_ptr()) or not thp
    assert len(storages) == len(linears)
    save_file(placed.state_dict(), str(tmp_path / "placed.safetensors"))  # refuses tensors that share memory
    saved = load_file(str(tmp_path / "placed.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    for a, b in zip(logits(model, [70, 5], 2), logits(placed, [70, 5], 2), strict=True):
        assert torch.equal(a, b)


def test_a_tiled_state_dict_is_the_rows_and_untiling_restores_them():
    model = bf16_model(None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.tile_weights()
    tiled_state = model.state_dict()
    assert state.keys() == tiled_state.keys()
    assert all(torch.equal(state[k], tiled_state[k]) for k in state)
    fresh = bf16_model(None)
    fresh.load_state_dict(tiled_state)  # saved from a tiled model, loaded into a plain one
    assert torch.equal(fresh.lm_head.weight, state["lm_head.weight"])
    assert model.untile_weights() > 0 and not any(is_tiled(p) for p in model.parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_tiled_model_loads_a_state_dict_of_rows_into_its_tiles():
    """load_state_dict of [N, K] matrices into a tiled model lays them out as its weights are (it had failed
    on the shapes): the weights stay tiled, read back as the rows given, and the logits are those of a
    plain model holding the same state, bit for bit."""
    source = bf16_model(False)
    source.model.layers[0].self_attn.q_proj.weight.mul_(3)  # a state other than the target's own
    target = bf16_model(False)
    target.tile_weights()
    given = source.state_dict()
    target.load_state_dict(given)
    assert is_tiled(target.lm_head.weight) and is_tiled(target.model.layers[0].self_attn.q_proj.weight)
    assert all(torch.equal(v, given[k]) for k, v in target.state_dict().items())
    assert given["lm_head.weight"].dim() == 2  # the caller's dictionary is left as it was
    for a, b in zip(logits(source, [5, 9], 2), logits(target, [5, 9], 2), strict=True):
        assert torch.equal(a, b)


def test_state_entries_name_a_tiled_state_without_making_it(monkeypatch):
    """`state_entries` gives state_dict()'s names, shapes and dtypes (a tiled weight as [N, K], tied
    embeddings under both names) without untiling a matrix, and loading into a tiled model untiles none."""
    from k3.model import tiling

    model = bf16_model(False)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one parameter under two names
    model.tile_weights()
    state = model.state_dict()
    state["model.layers.0.self_attn.q_proj.weight"] *= 2

    def untiled(*args):
        raise AssertionError("a matrix was untiled")

    monkeypatch.setattr(tiling, "rows_of", untiled)
    entries = tiling.state_entries(model)
    assert entries == {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    model.load_state_dict(state)
    monkeypatch.undo()
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_gradients_flow_through_a_tiled_weight_to_the_input():
    """A tiled Linear under autograd (its weight frozen, the input trainable) computes the untiled one's
    output and input gradient."""
    model = bf16_model(None)
    linear = model.model.layers[0].self_attn.q_proj
    tiled = copy.deepcopy(linear)
    tiled.weight = torch.nn.Parameter(by_torch(linear.weight.data), requires_grad=False)
    x = torch.randn(3, 7, matrix_shape(linear.weight)[1], generator=gen(4), requires_grad=True)
    y = linear(x)
    (dx,) = torch.autograd.grad(y.square().sum(), x)
    y_tiled = tiled(x)
    (dx_tiled,) = torch.autograd.grad(y_tiled.square().sum(), x)
    assert torch.equal(y, y_tiled) and torch.equal(dx, dx_tiled)


def test_rows_taken_back_from_blocks_into_a_buffer(monkeypatch):
    """rows_of(..., out=) as a prefill's GEMM takes a tiled or paired weight's rows (the native
    rows_from_blocks): each range of whole blocks equal to the matrix's own rows, float32 (exact) and
    bfloat16, at 1 and 2 threads, a paired layout written by torch too; torch's own copy (no native module)
    gives the same; ranges that cut a block and buffers of the wrong shape or dtype are refused."""
    native = load_native()
    g = gen(7)
    w = torch.randn(48, 7168, generator=g).bfloat16()
    paired = w.view(3, 16, 3584, 2).transpose(1, 2).contiguous()  # [N/16, K/2, 16 rows, 2 columns]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for blocks, step in ((by_torch(w), 8), (paired, 16)):
                for start, stop in ((0, 48), (step, 48), (0, step), (16, 32), (48, 48)):
                    for dtype in (torch.float32, torch.bfloat16):
                        out = torch.full((stop - start, 7168), float("nan"), dtype=dtype)
                        assert rows_of(blocks, start, stop, out=out) is out
                        assert torch.equal(out, w[start:stop].to(dtype)), (step, start, stop, dtype)
    finally:
        torch.set_num_threads(before)
    out = torch.empty(16, 7168)
    monkeypatch.setattr("k3.model.tiling.load_native", lambda: None)  # torch's copy from the blocks' view
    assert torch.equal(rows_of(by_torch(w), 8, 24, out=out), w[8:24].float())
    with pytest.raises(RuntimeError, match="whole blocks"):
        native.rows_from_blocks(by_torch(w), 4, 12, torch.empty(8, 7168))
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16 CPU matrix \[16, 7168\]"):
        native.rows_from_blocks(by_torch(w), 8, 24, torch.empty(16, 7168, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="out must be"):
        native.rows_from_blocks(by_torch(w), 8, 24, torch.empty(8, 7168))
    with pytest.raises(RuntimeError, match="blocks"):
        native.rows_from_blocks(w, 0, 8, torch.empty(8, 7168))  # rows, not blocks


def test_what_is_not_tiled_and_bad_requests():
    model = bf16_model(None)
    model.compute_dtype = torch.bfloat16  # bf16 computation converts per product: tiling would not pay
    assert model.tile_weights() == 0
    training = K3ForCausalLM.from_config(K3Config.preset("mini"), seed=1)  # weights that want gradients
    assert training.tile_weights() == 0
    native = load_native()
    with pytest.raises(RuntimeError, match="multiples of 8"):
        native.tile_rows(torch.zeros(12, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="blocks of 8"):
        rows_of(by_torch(torch.zeros(16, 16, dtype=torch.bfloat16)), 4, 16)


def test_untiling_leaves_other_four_dimensional_weights_alone():
    """A convolution's weight (the vision tower's patch embedding) has four dimensions too: untouched."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 2), Linear(16, 8)).requires_grad_(False)
    model[1].weight.data = torch.randn(8, 16, generator=gen(6)).bfloat16()
    conv, rows = model[0].weight.clone(), model[1].weight.clone()
    assert tile_weights(model) == rows.nbytes and is_tiled(model[1].weight)
    assert untile_weights(model) == rows.nbytes
    assert torch.equal(model[0].weight, conv) and torch.equal(model[1].weight, rows)
