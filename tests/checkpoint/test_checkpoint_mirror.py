"""The sparse local mirror of a remote file: interval bookkeeping against a set of bytes, bytes against the
file, each page fetched once (the Range server's log), and copy-on-write views that never reach the file."""

from __future__ import annotations

import mmap
import os
import random

import torch
from safetensors.torch import save_file

import k3.checkpoint.source as source_module
from k3.checkpoint import open_checkpoint
from k3.checkpoint.mirror import PAGE, MirroredSource, Ranges
from k3.checkpoint.remote import HttpClient, HttpSource, RemoteOptions
from k3.checkpoint.serve import RangeServer
from k3.checkpoint.source import LocalSource, device_readahead


def test_ranges_match_a_set_of_bytes():
    rng = random.Random(0)
    for _ in range(200):
        r, model = Ranges(), set()
        for _ in range(rng.randint(1, 12)):
            a = rng.randrange(0, 200)
            b = a + rng.randrange(0, 40)
            r.add(a, b)
            model |= set(range(a, b))
            intervals = r.intervals()
            assert all(b1 < a2 for (_, b1), (a2, _) in zip(intervals, intervals[1:], strict=False))
            assert {x for a2, b2 in intervals for x in range(a2, b2)} == model and len(r) == len(model)
        a = rng.randrange(0, 240)
        b = a + rng.randrange(0, 60)
        missing = {x for a2, b2 in r.missing(a, b) for x in range(a2, b2)}
        assert missing == set(range(a, b)) - model


def test_mirror_reads_the_file_fetching_each_page_once(tmp_path):
    data = bytes(random.Random(1).randbytes(300_000))
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "blob.bin").write_bytes(data)
    with RangeServer(tmp_path / "srv") as server:
        http = HttpClient(RemoteOptions(first_read=5000))
        mirror = MirroredSource(HttpSource(server.url + "/blob.bin", http), tmp_path, parallel=3)
        rng = random.Random(2)
        for _ in range(60):
            a = rng.randrange(0, len(data))
            n = rng.randrange(0, min(20_000, len(data) - a) + 1)
            assert bytes(mirror.read(a, n)) == data[a : a + n]
        ranges = [tuple(int(x) for x in h[len("bytes=") :].split("-")) for _, h in server.requests[1:]]
        served = sum(b + 1 - a for a, b in ranges)
        assert served == len(mirror.present) - 4096  # disjoint; the first page came with the open
        assert all(a % PAGE == 0 and ((b + 1) % PAGE == 0 or b + 1 == len(data)) for a, b in ranges)
        view = torch.frombuffer(mirror.read(0, 8192), dtype=torch.uint8)
        view += 1  # a private copy of those pages
        assert bytes(mirror.read(0, 8192)) == bytes((x + 1) % 256 for x in data[:8192])
        assert (tmp_path / "srv" / "blob.bin").read_bytes() == data
        mirror.close()
        http.close()


def test_mirrored_checkpoint_reads_equal_tensors(tmp_path):
    tensors = {f"t{i}": torch.randn(3 + i, 50 + 7 * i) for i in range(20)}
    (tmp_path / "ckpt").mkdir()
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    with RangeServer(tmp_path / "ckpt") as server:
        with open_checkpoint(server.url, mirror=tmp_path) as ckpt:
            assert ckpt.prefetch(["t3", "t4"]) > 0 and ckpt.prefetch(["t3"]) == 0
            for name, t in tensors.items():
                assert torch.equal(ckpt.read(name), t)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_map_span_faults_pages_in_and_unmap_span_gives_them_back(tmp_path):
    """A local shard's span used in place (what `k3 stream` does locally): mapped and resident after
    map_span, out of this process's resident memory after unmap_span, the same bytes either way."""
    data = torch.randint(0, 256, (64 * 2**20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    save_file({"blob": data}, str(tmp_path / "model.safetensors"))
    with open_checkpoint(tmp_path) as ckpt:
        t = ckpt.info("blob")
        before = _rss()
        view = ckpt.map_span(t.shard, t.start, t.end)
        assert _rss() - before >= 60 * 2**20  # faulted in by map_span itself, before any read
        assert torch.equal(torch.frombuffer(view, dtype=torch.uint8), data)
        ckpt.unmap_span(t.shard, t.start, t.end)
        assert _rss() - before < 4 * 2**20
        assert torch.equal(torch.frombuffer(view, dtype=torch.uint8)[-5:], data[-5:])  # faults back in


def test_populate_reads_the_bytes_with_and_without_advice(tmp_path):
    """Both ways of faulting a span in (population alone on a wide readahead window, WILLNEED advice
    ahead of it on a narrow one) give the file's bytes, over spans longer than READ_AHEAD and ragged."""
    data = random.Random(0).randbytes(3 * source_module.READ_AHEAD + 12345)
    path = tmp_path / "blob"
    path.write_bytes(data)
    for wide in (True, False):
        source = LocalSource(path)
        source._wide_readahead = wide
        for offset, length in [(0, len(data)), (7, source_module.READ_AHEAD + 1), (len(data) - 100, 100)]:
            assert bytes(source.populate(offset, length)) == data[offset : offset + length]
        source.close()


def test_device_readahead_from_sysfs(tmp_path):
    """The window of the file's device from sysfs: its own queue, its disk's for a partition, else None."""
    st = os.stat(tmp_path)
    name = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    disk = tmp_path / "sys" / "disk"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "read_ahead_kb").write_text("128\n")
    (disk / "part").mkdir()
    sysfs = tmp_path / "sysfs"
    sysfs.mkdir()
    (sysfs / name).symlink_to(disk / "part")  # a partition: no queue of its own
    assert device_readahead(tmp_path, sysfs) == 128 * 1024
    (sysfs / name).unlink()
    (sysfs / name).symlink_to(disk)
    (disk / "queue" / "read_ahead_kb").write_text("8192\n")
    assert device_readahead(tmp_path, sysfs) == 8192 * 1024
    assert device_readahead(tmp_path, tmp_path / "nowhere") is None
