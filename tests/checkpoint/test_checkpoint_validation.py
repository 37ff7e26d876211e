"""One test per way a checkpoint can be broken: each must be a CheckpointError naming the file and tensor."""

import json
import struct
import time
import tracemalloc

import pytest
import torch
from ckpt_testing import entry, raw_safetensors

from k3.checkpoint import CheckpointError, open_checkpoint, save_checkpoint
from k3.config import K3Config
from k3.errors import K3Error

GOOD_DATA = bytes(range(24))  # tensor bytes for the hand-made files below


def broken(tmp_path, content: bytes, name: str = "model.safetensors"):
    """Write `content` as the only shard and return the error opening it raises."""
    (tmp_path / name).write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(tmp_path).close()
    assert isinstance(e.value, K3Error)
    return str(e.value)


def test_checkpoint_error_is_a_k3_error():
    assert issubclass(CheckpointError, K3Error)


def test_header_length_past_end_of_file(tmp_path):
    msg = broken(tmp_path, raw_safetensors({"w": entry("U8", [4], 0, 4)}, b"abcd", header_len=10_000))
    assert "model.safetensors" in msg and "header length 10000 runs past the end of the file" in msg


def test_header_length_above_cap_does_not_allocate(tmp_path):
    content = struct.pack("<Q", 2**60) + b"{}" + bytes(6)
    tracemalloc.start()
    t0 = time.perf_counter()
    msg = broken(tmp_path, content)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "model.safetensors" in msg and f"header length {2**60} exceeds" in msg
    assert peak < 10 * 2**20 and time.perf_counter() - t0 < 1.0


def test_too_short_for_a_length(tmp_path):
    assert "truncated: 5 bytes" in broken(tmp_path, b"\x08\x00\x00\x00\x00")


def test_malformed_json(tmp_path):
    msg = broken(tmp_path, raw_safetensors(b'{"w": {"dtype": "U8",', b""))
    assert "model.safetensors" in msg and "malformed JSON" in msg


def test_header_not_an_object(tmp_path):
    assert "does not start with '{'" in broken(tmp_path, raw_safetensors(b"[1, 2]", b""))
    assert "not UTF-8" in broken(tmp_path, raw_safetensors(b'{"\xff": 1}', b""))


def test_entry_not_an_object(tmp_path):
    msg = broken(tmp_path, raw_safetensors({"w": [1, 2, 3]}, b""))
    assert "model.safetensors: tensor 'w': entry is list" in msg


def test_entry_missing_key(tmp_path):
    msg = broken(tmp_path, raw_safetensors({"w": {"dtype": "U8", "shape": [1]}}, b"a"))
    assert "tensor 'w': no 'data_offsets'" in msg


def test_unknown_dtype(tmp_path):
    msg = broken(tmp_path, raw_safetensors({"w": entry("Q4", [4], 0, 4)}, b"abcd"))
    assert "model.safetensors: tensor 'w': unknown dtype 'Q4'" in msg


@pytest.mark.parametrize("shape", [[-1, 4], [2.0, 2], "4", [True, 4], [2**64]])
def test_shape_not_a_list_of_non_negative_ints(tmp_path, shape):
    msg = broken(tmp_path, raw_safetensors({"w": entry("U8", shape, 0, 4)}, b"abcd"))
    assert "model.safetensors: tensor 'w': shape" in msg and "not a list of non-negative integers" in msg


@pytest.mark.parametrize("offsets", [[0], [0, -4], [0, "4"], None])
def test_offsets_not_a_pair(tmp_path, offsets):
    content = raw_safetensors({"w": {"dtype": "U8", "shape": [4], "data_offsets": offsets}}, b"abcd")
    assert "tensor 'w': data_offsets" in broken(tmp_path, content)


def test_offsets_backwards(tmp_path):
    msg = broken(tmp_path, raw_safetensors({"w": entry("U8", [0], 4, 0)}, b"abcd"))
    assert "tensor 'w': data_offsets [4, 0] run backwards" in msg


def test_shape_times_dtype_differs_from_range(tmp_path):
    msg = broken(tmp_path, raw_safetensors({"w": entry("F32", [2, 3], 0, 20)}, GOOD_DATA[:20]))
    assert "model.safetensors: tensor 'w': shape [2, 3] x F32" in msg and "hold 20" in msg


def test_overlapping_ranges(tmp_path):
    header = {"a": entry("U8", [8], 0, 8), "b": entry("U8", [8], 4, 12)}
    msg = broken(tmp_path, raw_safetensors(header, GOOD_DATA[:12]))
    assert "model.safetensors: tensor 'b': data_offsets [4, 12] overlap" in msg


def test_gap_between_tensors(tmp_path):
    header = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 8, 12)}
    msg = broken(tmp_path, raw_safetensors(header, GOOD_DATA[:12]))
    assert "model.safetensors: tensor 'b'" in msg and "bytes [4, 8) belong to no tensor" in msg


def test_data_not_fully_covered(tmp_path):
    msg = broken(tmp_path, raw_safetensors({"a": entry("U8", [4], 0, 4)}, GOOD_DATA[:10]))
    assert "model.safetensors: data section has 10 bytes" in msg and "after tensor 'a'" in msg


def test_range_beyond_end_of_file(tmp_path):
    header = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [100], 4, 104)}
    msg = broken(tmp_path, raw_safetensors(header, GOOD_DATA[:8]))
    assert "model.safetensors: tensor 'b': data_offsets [4, 104] run past the end" in msg


def test_duplicate_names(tmp_path):
    header = b'{"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, '
    header += b'"w": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}'
    msg = broken(tmp_path, raw_safetensors(header, b"abcd"))
    assert "model.safetensors (header): duplicate key 'w'" in msg


def test_metadata_not_strings(tmp_path):
    header = {"__metadata__": {"format": 1}, "w": entry("U8", [1], 0, 1)}
    assert "__metadata__ must be an object of strings" in broken(tmp_path, raw_safetensors(header, b"a"))


def test_truncated_shard(tmp_path):
    save_checkpoint([("a", torch.zeros(4)), ("b", torch.ones(8))], None, tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'b'.*truncated shard"):
        open_checkpoint(tmp_path)


def test_empty_file(tmp_path):
    assert "truncated: 0 bytes" in broken(tmp_path, b"")


# ---- the index ----------------------------------------------------------------------------------------
@pytest.fixture
def sharded(tmp_path):
    tensors = [(name, torch.full((4,), float(i))) for i, name in enumerate("abcde")]
    save_checkpoint(tensors, None, tmp_path, max_shard_size=32)  # shards [a, b], [c, d], [e]
    return tmp_path


def edit_index(directory, edit):
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


def test_index_names_missing_shard(sharded):
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"index\.json: shard model-00002-of-00003\.safetensors .*'c'.* missing"
    ):
        open_checkpoint(sharded)


def test_index_names_tensor_not_in_shard(sharded):
    edit_index(sharded, lambda wm: wm.update(ghost="model-00001-of-00003.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"index\.json: tensor 'ghost' is mapped to model-00001-of-00003"
    ):
        open_checkpoint(sharded)


def test_shard_tensor_not_in_index(sharded):
    edit_index(sharded, lambda wm: wm.pop("d"))
    with pytest.raises(
        CheckpointError, match=r"model-00002-of-00003\.safetensors: tensor 'd' .* does not list it"
    ):
        open_checkpoint(sharded)


def test_index_maps_tensor_to_other_shard(sharded):
    edit_index(sharded, lambda wm: wm.update(d="model-00001-of-00003.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"00002-of-00003\.safetensors: tensor 'd' is in this shard but .* maps it to model-00001",
    ):
        open_checkpoint(sharded)


def test_index_shard_name_escaping_the_directory(sharded):
    edit_index(sharded, lambda wm: wm.update(a="../secret.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'a' maps to '\.\./secret\.safetensors', not a plain"):
        open_checkpoint(sharded)


def test_index_duplicate_names(sharded):
    path = sharded / "model.safetensors.index.json"
    text = path.read_text().replace('"b": ', '"a": "model-00001-of-00003.safetensors", "b": ', 1)
    assert text.count('"a": ') == 2
    path.write_text(text)
    with pytest.raises(CheckpointError, match=r"index\.json: duplicate key 'a'"):
        open_checkpoint(sharded)


def test_same_tensor_in_two_shards_without_index(tmp_path):
    save_checkpoint([("w", torch.zeros(2))], None, tmp_path / "x")
    (tmp_path / "one.safetensors").write_bytes((tmp_path / "x" / "model.safetensors").read_bytes())
    (tmp_path / "two.safetensors").write_bytes((tmp_path / "x" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"two\.safetensors: tensor 'w' is also in one\.safetensors"):
        open_checkpoint(tmp_path)


def test_total_size_disagreement_is_a_finding(sharded):
    path = sharded / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["metadata"]["total_size"] = 1
    path.write_text(json.dumps(index))
    with open_checkpoint(sharded) as ckpt:
        assert ckpt.findings == [
            "model.safetensors.index.json declares total_size 1, the shards hold 80 bytes of tensors"
        ]


def test_shard_file_outside_the_index_is_a_finding(sharded):
    edit_index(sharded, lambda wm: wm.pop("e"))
    with open_checkpoint(sharded) as ckpt:
        assert "e" not in ckpt and ckpt.shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2)]
        assert any("model-00003-of-00003.safetensors" in f and "not named by" in f for f in ckpt.findings)


# ---- what is not a safetensors checkpoint ---------------------------------------------------------------
def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    with pytest.raises(
        CheckpointError, match="only pickle-based weights .*pytorch_model.bin.*never unpickles"
    ):
        open_checkpoint(tmp_path)
    (tmp_path / "model.pt").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointError, match="model.pt: a pickle-based checkpoint; k3 never unpickles"):
        open_checkpoint(tmp_path / "model.pt")


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json, model.safetensors"):
        open_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such file or directory"):
        open_checkpoint(tmp_path / "missing")


def test_broken_config_does_not_stop_reading(tmp_path):
    save_checkpoint([("w", torch.zeros(2))], None, tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.config is None and ckpt.raw_config is None
        assert "config.json: malformed JSON" in ckpt.config_error
        assert ckpt.read("w").tolist() == [0.0, 0.0]


def test_config_of_the_wrong_shape_is_not_fatal(tmp_path):
    save_checkpoint([("w", torch.zeros(2))], None, tmp_path)
    raw = K3Config.preset("tiny").to_dict()
    raw["text_config"]["linear_attn_config"] = 5
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with open_checkpoint(tmp_path) as ckpt:
        assert ckpt.config is None and ckpt.raw_config == raw
        assert ckpt.config_error.startswith("config.json is not a K3-family config")
