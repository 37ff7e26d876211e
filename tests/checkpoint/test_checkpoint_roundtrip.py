"""Write -> read round trips, checked against the official safetensors library in both directions."""

import gc
import json
import os
import weakref

import pytest
import torch
from ckpt_testing import TORCH, random_tensor, same, tiny_tensors
from safetensors import safe_open
from safetensors.torch import save_file

from k3.checkpoint import CheckpointError, open_checkpoint, save_checkpoint
from k3.checkpoint.writer import with_converter_keys
from k3.config import K3Config

K3_DTYPES = ["BF16", "F16", "F32", "U8", "I32", "I64"]


def mixed_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Every supported dtype, a scalar, an empty tensor, and an odd-sized U8 tensor that leaves the next
    tensor misaligned."""
    gen = torch.Generator().manual_seed(seed)
    out = [(f"t.{d.lower()}", random_tensor((3, 5), d, gen)) for d in TORCH]
    out += [
        ("odd.u8", random_tensor((7,), "U8", gen)),
        ("after_odd.f32", random_tensor((4, 3), "F32", gen)),
        ("after_odd.bf16", random_tensor((9,), "BF16", gen)),
        ("scalar.f32", torch.tensor(3.5)),
        ("empty.i64", torch.empty((0, 4), dtype=torch.int64)),
    ]
    return out


@pytest.mark.parametrize("max_shard_size", [None, 64], ids=["unsharded", "sharded"])
def test_round_trip_every_dtype(tmp_path, max_shard_size):
    tensors = mixed_tensors()
    written = save_checkpoint(
        tensors, None, tmp_path, max_shard_size=max_shard_size, metadata={"who": "test"}
    )
    names = sorted(p.name for p in tmp_path.iterdir())
    if max_shard_size is None:
        assert names == ["model.safetensors"] and written == [tmp_path / "model.safetensors"]
    else:
        assert "model.safetensors.index.json" in names and "model.safetensors" not in names
        assert len(names) > 3
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.names == [n for n, _ in tensors]  # file order is the order written
        assert ckpt.config is None and ckpt.config_error == "no config.json"
        assert ckpt.total_tensors == len(tensors)
        assert ckpt.total_bytes == sum(t.numel() * t.element_size() for _, t in tensors)
        for name, t in tensors:
            assert same(ckpt.read(name), t), name
            assert name in ckpt and ckpt.info(name).shape == tuple(t.shape)
        for meta in ckpt.metadata.values():
            assert meta == {"format": "pt", "who": "test"}
    # The official library reads k3's files, tensor for tensor.
    for shard in sorted(tmp_path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt", "who": "test"}
            for name in f.keys():
                assert same(f.get_tensor(name), dict(tensors)[name]), name


def test_index_contents(tmp_path):
    tensors = mixed_tensors()
    save_checkpoint(tensors, None, tmp_path, max_shard_size=64)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    m = len(shards)
    assert shards == [f"model-{i:05d}-of-{m:05d}.safetensors" for i in range(1, m + 1)]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in tensors)
    assert set(index["weight_map"]) == {n for n, _ in tensors}
    for name, shard in index["weight_map"].items():
        with safe_open(tmp_path / shard, framework="pt") as f:
            assert name in f.keys()
    umask = os.umask(0o022)
    os.umask(umask)
    for path in tmp_path.iterdir():  # ordinary permissions, not a temporary file's 0600
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path.name


@pytest.mark.parametrize("dtype", K3_DTYPES)
def test_files_from_official_writer(tmp_path, dtype):
    gen = torch.Generator().manual_seed(1)
    tensors = {"a": random_tensor((4, 6), dtype, gen), "b.c": random_tensor((5,), dtype, gen)}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with open_checkpoint(tmp_path) as ckpt:
        assert sorted(ckpt.names) == ["a", "b.c"]
        for name, t in tensors.items():
            assert same(ckpt.read(name), t)
            assert same(ckpt.read_rows(name, 1, 3), t[1:3])


def test_k3_layout_with_config_sharded(tmp_path):
    cfg = K3Config.preset("tiny")
    tensors = list(tiny_tensors(cfg))
    save_checkpoint(iter(tensors), cfg, tmp_path, max_shard_size=200_000)
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.config is not None and ckpt.config.to_dict() == with_converter_keys(cfg.to_dict())
        assert ckpt.config_error is None and ckpt.findings == []
        assert len(ckpt.shards) > 1
        for name, t in tensors:
            assert same(ckpt.read(name), t)
        # file order: shard order, then offset
        order = [(ckpt.shards.index(t.shard), t.start) for t in ckpt.tensors()]
        assert order == sorted(order)
    raw = json.loads((tmp_path / "config.json").read_text())  # what llama.cpp's converter needs
    assert raw["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert raw["text_config"]["architectures"] == ["KimiLinearForCausalLM"]
    assert "linear_attn_config" in raw["text_config"] and "moe_router_activation_func" in raw["text_config"]


def test_always_index_writes_one_indexed_shard(tmp_path):
    save_checkpoint(
        mixed_tensors(), {"model_type": "other"}, tmp_path, max_shard_size=None, always_index=True
    )
    assert (tmp_path / "model-00001-of-00001.safetensors").is_file()
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.raw_config == {"model_type": "other"}
        assert ckpt.config is None and "not a K3-family config" in ckpt.config_error


def test_big_tensor_gets_its_own_shard(tmp_path):
    tensors = [("small1", torch.zeros(4)), ("big", torch.zeros(100)), ("small2", torch.zeros(4))]
    save_checkpoint(tensors, None, tmp_path, max_shard_size=64)
    with open_checkpoint(tmp_path) as ckpt:
        assert [t.shard for t in ckpt.tensors()] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def test_read_rows(tmp_path):
    t = torch.arange(60, dtype=torch.float32).reshape(10, 3, 2)
    save_checkpoint([("x", t), ("s", torch.tensor(1))], None, tmp_path)
    with open_checkpoint(tmp_path) as ckpt:
        assert same(ckpt.read_rows("x", 2, 7), t[2:7])
        assert ckpt.read_rows("x", 4, 4).shape == (0, 3, 2)
        with pytest.raises(CheckpointError, match="'x' has 10 rows"):
            ckpt.read_rows("x", 3, 11)
        with pytest.raises(CheckpointError, match="'s' is a scalar"):
            ckpt.read_rows("s", 0, 1)
        with pytest.raises(CheckpointError, match="no tensor 'nope'"):
            ckpt.read("nope")


def test_local_reads_are_zero_copy_and_never_write_the_file(tmp_path):
    t = torch.arange(16, dtype=torch.float32)
    save_checkpoint([("x", t)], None, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    with open_checkpoint(tmp_path) as ckpt:
        a, b = ckpt.read("x"), ckpt.read("x")
        assert a.data_ptr() == b.data_ptr()  # both are views of the same mapped page, not copies
        a[0] = 42.0  # copy-on-write: a private page, the file is untouched
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert a[0] == 42.0 and a[1] == 1.0  # still usable after close()
    with pytest.raises(CheckpointError, match="checkpoint is closed"):
        ckpt.read("x")


def test_writer_holds_one_tensor_at_a_time(tmp_path):
    refs = []

    def tensors():
        for i in range(6):
            t = torch.full((1000,), float(i))
            refs.append(weakref.ref(t))
            yield f"t{i}", t
            del t
            gc.collect()
            assert refs[-1]() is None, "the writer kept a reference to a tensor it has written"

    save_checkpoint(tensors(), None, tmp_path, max_shard_size=10_000)
    with open_checkpoint(tmp_path) as ckpt:
        assert [ckpt.read(f"t{i}")[0].item() for i in range(6)] == list(range(6))


def test_failed_write_leaves_nothing(tmp_path):
    def tensors():
        yield "a", torch.zeros(100)
        yield "b", torch.zeros(100)
        raise RuntimeError("the producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        save_checkpoint(tensors(), {"model_type": "x"}, tmp_path, max_shard_size=500)
    assert list(tmp_path.iterdir()) == []


def test_writer_refusals(tmp_path):
    with pytest.raises(CheckpointError, match="'z' has unsupported type torch.complex64"):
        save_checkpoint([("z", torch.zeros(2, dtype=torch.complex64))], None, tmp_path / "a")
    with pytest.raises(CheckpointError, match="'x' is a duplicate"):
        save_checkpoint([("x", torch.zeros(2)), ("x", torch.ones(2))], None, tmp_path / "b")
    assert list((tmp_path / "b").iterdir()) == []
    save_checkpoint([("x", torch.zeros(2))], None, tmp_path / "c")
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        save_checkpoint([("y", torch.zeros(2))], None, tmp_path / "c")


def test_overwrite_replaces_the_old_layout(tmp_path):
    save_checkpoint(mixed_tensors(0), None, tmp_path, max_shard_size=64)
    save_checkpoint([("only", torch.ones(3))], None, tmp_path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.names == ["only"]
