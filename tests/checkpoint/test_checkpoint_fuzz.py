"""Property-based fuzzing of header parsing: corrupted files end in CheckpointError or a correct read.

Base files come from the official writer (`safetensors.torch.save`); each case corrupts one thing (the
length field, bytes of the header, one field of one entry, the whole header, the file's end) and opens the
result. "Correct" is judged by the official reader: whatever k3 accepts, `safetensors.torch.load` must
accept too, with bit-identical tensors. Any other exception, a hang or a large allocation fails the test
(allocation is bounded by the tiny files plus the header cap, checked in test_checkpoint_validation).
"""

import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from ckpt_testing import TORCH, random_tensor, same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as official_load
from safetensors.torch import save as official_save

from k3.checkpoint import CheckpointError, open_checkpoint

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=6).filter(
    lambda s: s != "__metadata__"
)
specs = st.lists(
    st.tuples(names, st.sampled_from(sorted(TORCH)), st.lists(st.integers(0, 4), max_size=3)),
    max_size=4,
    unique_by=lambda t: t[0],
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


def base_file(spec: list, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: random_tensor(tuple(shape), dtype, gen) for name, dtype, shape in spec}
    return official_save(tensors, metadata={"format": "pt"})


def split(content: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", content[:8])
    return json.loads(content[8 : 8 + n]), content[8 + n :]


def join(header: bytes, data: bytes) -> bytes:
    header += b" " * (-(8 + len(header)) % 8)
    return struct.pack("<Q", len(header)) + header + data


def check(content: bytes) -> None:
    """Open `content` as a one-file checkpoint: an error must be a CheckpointError; a success must agree
    with the official reader."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "model.safetensors").write_bytes(content)
        try:
            ckpt = open_checkpoint(d)
        except CheckpointError:
            return
        with ckpt:
            got = {name: ckpt.read(name).clone() for name in ckpt.names}
            for t in ckpt.tensors():
                if t.shape and t.shape[0] >= 2:
                    assert same(ckpt.read_rows(t.name, 1, 2), got[t.name][1:2])
    expected = official_load(content)  # k3 accepted it: so must the official reader
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert same(got[name], tensor), name


@FUZZ
@given(specs, st.integers(0, 2**16), st.data())
def test_fuzz_length_field(spec, seed, data):
    content = base_file(spec, seed)
    size = len(content)
    n = data.draw(
        st.integers(0, 2**64 - 1) | st.integers(max(0, size - 24), size + 8) | st.sampled_from([2**60])
    )
    check(struct.pack("<Q", n) + content[8:])


@FUZZ
@given(specs, st.integers(0, 2**16), st.data())
def test_fuzz_truncation(spec, seed, data):
    content = base_file(spec, seed)
    check(content[: data.draw(st.integers(0, len(content)))])


@FUZZ
@given(specs, st.integers(0, 2**16), st.data())
def test_fuzz_header_bytes(spec, seed, data):
    content = bytearray(base_file(spec, seed))
    (n,) = struct.unpack("<Q", content[:8])
    for _ in range(data.draw(st.integers(1, 4))):
        content[data.draw(st.integers(8, 8 + n - 1))] = data.draw(st.integers(0, 255))
    check(bytes(content))


@FUZZ
@given(specs.filter(bool), st.integers(0, 2**16), st.data())
def test_fuzz_entry_fields(spec, seed, data):
    header, body = split(base_file(spec, seed))
    name = data.draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
    value = data.draw(
        json_values
        | st.sampled_from(["F32", "U8", "BF16", "I64", "BOOL", "Q4"])
        | st.lists(st.integers(-2, 2**64 + 1), max_size=3)
    )
    if data.draw(st.booleans()):
        header[name][field] = value
    else:
        header[name].pop(field, None)
    check(join(json.dumps(header).encode(), body))


@FUZZ
@given(specs, st.integers(0, 2**16), json_values, st.booleans())
def test_fuzz_whole_header(spec, seed, value, duplicate):
    header, body = split(base_file(spec, seed))
    raw = json.dumps(value).encode()
    if duplicate and len(header) > 1:  # the same key twice, as JSON allows and safetensors must refuse
        key, entry = next((k, v) for k, v in header.items() if k != "__metadata__")
        raw = json.dumps(header).encode()[:-1] + b", " + json.dumps({key: entry}).encode()[1:]
    check(join(raw, body))
