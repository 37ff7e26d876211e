"""`from_pretrained(url)` reads the dense weights at load and each routed expert on first use, into mirror
files the tensors are mapped from. Checked through the Range server's own request log: which bytes went
out, against the checkpoint's headers and what `record_routing` saw the routers choose."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from k3.checkpoint import open_checkpoint
from k3.checkpoint.mirror import PAGE, Ranges
from k3.checkpoint.remote import RemoteOptions
from k3.checkpoint.serve import RangeServer
from k3.model import K3ForCausalLM, fused
from k3.model.loading import match_layout, model_name
from k3.model.on_demand import expert_of, experts_on_demand
from k3.model.routing import record_routing

_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


def served(server: RangeServer, skip_first_reads: bool) -> dict[str, list[tuple[int, int]]]:
    """Per shard, the byte ranges the server answered, in order (the open-time probes of the first
    `first_read` bytes of each shard left out when asked)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for path, header in server.requests:
        m = _RANGE.fullmatch(header or "")
        if m is None:
            continue  # config.json, the index
        a, b = int(m.group(1)), int(m.group(2)) + 1
        if skip_first_reads and a == 0 and b == RemoteOptions().first_read:
            continue
        out.setdefault(path.lstrip("/"), []).append((a, b))
    return out


def union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    r = Ranges()
    for a, b in ranges:
        r.add(a, b)
    return r.intervals()


def pages(
    ckpt, names: list[str], present: dict[str, Ranges], headers: bool = False
) -> dict[str, list[tuple[int, int]]]:
    """The bytes a mirror must fetch for these tensors (and the shards' headers): their pages (clamped to
    the file), less `present`."""
    sizes = {shard: ckpt._sources[shard].size for shard in ckpt.shards}
    spans = [(ckpt.info(n).shard, ckpt.info(n).start, ckpt.info(n).end) for n in names]
    if headers:
        for shard in ckpt.shards:
            with open(Path(ckpt.location) / shard, "rb") as f:
                spans.append((shard, 8, 8 + int.from_bytes(f.read(8), "little")))
    wanted: dict[str, Ranges] = {}
    for shard, a, b in spans:
        wanted.setdefault(shard, Ranges()).add(a // PAGE * PAGE, min(-(-b // PAGE) * PAGE, sizes[shard]))
    out = {}
    for shard, r in wanted.items():
        have = present.get(shard, Ranges())
        parts = [p for a, b in r.intervals() for p in have.missing(a, b)]
        if parts:
            out[shard] = parts
    return out


def assert_disjoint(ranges: list[tuple[int, int]]) -> None:
    assert sum(b - a for a, b in ranges) == sum(b - a for a, b in union(ranges)), "a byte was served twice"


def test_url_load_reads_dense_bytes_then_exactly_the_chosen_experts(checkpoints, tmp_path):
    ckpt_dir = checkpoints("k3ish")
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 1]])
    local = K3ForCausalLM.from_pretrained(ckpt_dir)
    with torch.no_grad():
        reference = local(ids)
    with open_checkpoint(ckpt_dir) as ckpt, RangeServer(ckpt_dir) as server:
        cfg = ckpt.config
        names = match_layout(cfg, {t.name: (t.dtype, tuple(t.shape)) for t in ckpt.tensors()}, 8, "")
        paths = {model_name(cfg, published): name for published, name in names.items()}
        dense = [name for path, name in paths.items() if expert_of(path) is None]
        first = RemoteOptions().first_read
        present = {}
        for shard in ckpt.shards:  # what opening fetched first: the first pages of every shard
            size = ckpt._sources[shard].size
            present[shard] = Ranges()
            present[shard].add(0, size if size <= first else first // PAGE * PAGE)

        model = K3ForCausalLM.from_pretrained(server.url, mirror_dir=tmp_path)
        at_load = served(server, skip_first_reads=True)
        expected = pages(ckpt, dense, present, headers=True)  # headers longer than the first read
        assert {s: union(r) for s, r in at_load.items()} == expected
        for r in at_load.values():
            assert_disjoint(r)
        on_demand = experts_on_demand(model)
        assert on_demand is not None and len(on_demand.missing) == 7 * 16  # 7 MoE layers, none read

        for shard, parts in expected.items():
            for a, b in parts:
                present[shard].add(a, b)
        server.reset_counters()
        with torch.no_grad(), record_routing(model) as trace:
            logits = model(ids)
        chosen = {(layer, e) for layer in trace.layers for e in trace.indices(layer).unique().tolist()}
        experts = [name for path, name in paths.items() if expert_of(path) in chosen]
        in_forward = served(server, skip_first_reads=False)
        assert {s: union(r) for s, r in in_forward.items()} == pages(ckpt, experts, present)
        for r in in_forward.values():
            assert_disjoint(r)
        assert on_demand.missing == {(layer, e) for layer in trace.layers for e in range(16)} - chosen
        assert torch.equal(logits, reference)

        server.reset_counters()
        with torch.no_grad():
            assert torch.equal(model(ids), reference)  # the same experts again: nothing fetched
        assert server.bytes_served == 0

        moes = {i: model.model.layers[i].block_sparse_moe for i in trace.layers}
        for index, moe in moes.items():  # a layer asks for experts while some are missing, not after
            assert (moe.load_experts is None) == all(layer != index for layer, _ in on_demand.missing)
        for index in moes:
            on_demand.load(index, torch.arange(16))  # every expert of every layer
        assert not on_demand.missing and all(moe.load_experts is None for moe in moes.values())
        with torch.no_grad():
            assert torch.equal(model(ids), reference)


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_url_model_decodes_like_the_local_one(checkpoints, tmp_path, monkeypatch, dtype):
    """Prefill, then one-token steps with experts arriving as chosen: the one-token expert path (stored
    dtype) and the fused layer step (fp32, k3.model.fused), which must fetch its chosen experts too."""
    fused_moe = []
    chosen = fused.moe_experts_arguments  # the fused MoE's pick of its chosen experts' matrices
    monkeypatch.setattr(fused, "moe_experts_arguments", lambda *a: fused_moe.append(out := chosen(*a)) or out)
    ckpt_dir = checkpoints("k3ish")
    local = K3ForCausalLM.from_pretrained(ckpt_dir, dtype=dtype)
    with RangeServer(ckpt_dir) as server, torch.no_grad():
        remote = K3ForCausalLM.from_pretrained(server.url, mirror_dir=tmp_path, dtype=dtype)
        caches = local.new_cache(), remote.new_cache()
        ids = torch.tensor([[3, 1, 4, 1, 5]])
        for _ in range(4):
            a, b = local(ids, caches[0]), remote(ids, caches[1])
            assert torch.equal(a, b)
            ids = a[:, -1:].argmax(-1)
    assert not list(tmp_path.iterdir())  # the mirror files are unnamed: nothing left in the folder
    if dtype is torch.float32:
        assert fused_moe and all(out is not None for out in fused_moe)  # the fused step ran every time
