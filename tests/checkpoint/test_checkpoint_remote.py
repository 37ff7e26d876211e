"""Remote checkpoints over a local Range-capable HTTP server: same results as local, headers-only opening,
retries on transient faults, clear errors on bad answers."""

import json

import pytest
import torch
from ckpt_testing import FaultyRangeServer, same, tiny_tensors

from k3.census import census_of
from k3.checkpoint import CheckpointError, RemoteOptions, open_checkpoint, save_checkpoint
from k3.config import K3Config

pytestmark = pytest.mark.timeout(120)
FAST = RemoteOptions(backoff=0.001, retries=3, timeout=5.0)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Two checkpoints: `tiny/` (K3 tiny preset, two shards + index + config) and `single/` (one file)."""
    root = tmp_path_factory.mktemp("served")
    cfg = K3Config.preset("tiny")
    save_checkpoint(tiny_tensors(cfg), cfg, root / "tiny", max_shard_size=400_000)
    save_checkpoint(
        [("a", torch.arange(10.0)), ("b", torch.ones(3, 4, dtype=torch.int32))], None, root / "single"
    )
    (root / "empty").mkdir()
    return root


@pytest.fixture
def server(root):
    with FaultyRangeServer(root) as s:
        yield s


def shard_paths(root, name):
    return sorted((root / name).glob("*.safetensors"))


def test_remote_equals_local(root, server):
    with (
        open_checkpoint(root / "tiny") as local,
        open_checkpoint(f"{server.url}/tiny", remote=FAST) as remote,
    ):
        assert list(remote.tensors()) == list(local.tensors())
        assert remote.shards == local.shards and remote.metadata == local.metadata
        assert remote.config.to_dict() == local.config.to_dict()
        for name in local.names:
            assert same(remote.read(name), local.read(name)), name
        name = "language_model.model.embed_tokens.weight"
        assert same(remote.read_rows(name, 100, 140), local.read_rows(name, 100, 140))


def test_open_fetches_headers_only(root, server):
    with open_checkpoint(f"{server.url}/tiny/") as ckpt:
        stats = ckpt.fetch_stats
        shards = shard_paths(root, "tiny")
        small = sum(
            (root / "tiny" / f).stat().st_size for f in ("config.json", "model.safetensors.index.json")
        )
        # config + index, then one 64 kB range per shard: every header fits in its first range
        assert stats.requests == 2 + len(shards)
        assert stats.bytes_fetched == small + sum(min(65536, p.stat().st_size) for p in shards)
        assert stats.bytes_fetched < sum(p.stat().st_size for p in shards) / 3
        assert server.bytes_served == stats.bytes_fetched  # the server saw the same
        before = stats.bytes_fetched
        ckpt.read_rows("language_model.lm_head.weight", 10, 12)  # lives past the first 64 kB
        assert stats.bytes_fetched - before == 2 * 64 * 2  # two rows of 64 BF16


def test_census_over_http_reads_headers_only(root, server):
    remote = census_of(f"{server.url}/tiny")
    local = census_of(str(root / "tiny"))
    assert remote.to_json() | {"source": None} == local.to_json() | {"source": None}
    assert remote.findings == []
    total = sum(p.stat().st_size for p in shard_paths(root, "tiny"))
    assert 0 < server.bytes_served < total / 3
    assert all(r is not None for path, r in server.requests if path.endswith(".safetensors"))


def test_long_header_takes_a_second_request(root, server):
    with open_checkpoint(f"{server.url}/tiny", remote=RemoteOptions(first_read=512)) as ckpt:
        # a second request for each header longer than the first 512 bytes (all but the vision tower's
        # shard, whose few tensors have a short header)
        long = [
            p for p in shard_paths(root, "tiny") if 8 + int.from_bytes(p.read_bytes()[:8], "little") > 512
        ]
        assert len(long) >= len(ckpt.shards) - 1
        assert ckpt.fetch_stats.requests == 2 + len(ckpt.shards) + len(long)
        assert ckpt.total_tensors == len(list(tiny_tensors(K3Config.preset("tiny"))))


def test_parallel_block_reads(root, server):
    name = "language_model.model.embed_tokens.weight"  # [1024, 64] BF16 = 128 kB
    options = RemoteOptions(block_size=4096, parallel=4, first_read=1024)
    with (
        open_checkpoint(root / "tiny") as local,
        open_checkpoint(f"{server.url}/tiny", remote=options) as ckpt,
    ):
        info = ckpt.info(name)
        before = ckpt.fetch_stats.requests
        assert same(ckpt.read(name), local.read(name))
        blocks = (info.end - 1) // 4096 - info.start // 4096 + 1
        assert ckpt.fetch_stats.requests - before == blocks > 30


def test_block_cache(root, server, tmp_path):
    options = RemoteOptions(block_size=8192, cache_dir=tmp_path / "cache")
    name = "language_model.lm_head.weight"
    with open_checkpoint(f"{server.url}/tiny", remote=options) as ckpt:
        first = ckpt.read(name).clone()
        assert ckpt.fetch_stats.cache_hits == 0
    with open_checkpoint(f"{server.url}/tiny", remote=options) as ckpt:
        before = ckpt.fetch_stats.bytes_fetched
        assert same(ckpt.read(name), first)
        assert ckpt.fetch_stats.bytes_fetched == before and ckpt.fetch_stats.cache_hits > 0
    cached = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert cached and not any(p.name.startswith(".tmp-") for p in cached)
    cached[0].write_bytes(b"damaged")  # a damaged block is fetched again, not trusted
    with open_checkpoint(f"{server.url}/tiny", remote=options) as ckpt:
        assert same(ckpt.read(name), first)


def test_single_file_without_index_or_config(root, server):
    with open_checkpoint(f"{server.url}/single", remote=FAST) as ckpt:
        assert ckpt.config is None and ckpt.config_error == "no config.json"
        assert ckpt.read("a").tolist() == list(range(10))
        assert ckpt.read("b").dtype == torch.int32
    with open_checkpoint(f"{server.url}/single/model.safetensors", remote=FAST) as ckpt:
        assert ckpt.names == ["a", "b"]


def test_not_found(server):
    with pytest.raises(
        CheckpointError, match=r"/empty: no model\.safetensors\.index\.json or model\.safetensors"
    ):
        open_checkpoint(f"{server.url}/empty", remote=FAST)
    with pytest.raises(CheckpointError, match=r"/empty/x\.safetensors: not found \(HTTP 404\)"):
        open_checkpoint(f"{server.url}/empty/x.safetensors", remote=FAST)


def test_missing_shard(root, server, tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}})
    )
    with (
        FaultyRangeServer(tmp_path) as s,
        pytest.raises(CheckpointError, match="shard model-00001-of-00001.* 404"),
    ):
        open_checkpoint(s.url, remote=FAST)


# ---- faults ------------------------------------------------------------------------------------------------
SHARD = "/single/model.safetensors"


@pytest.mark.parametrize("fault", ["500", "drop", "truncate"])
def test_transient_faults_are_retried(server, fault):
    server.faults[SHARD] += [fault, fault]
    with open_checkpoint(f"{server.url}/single", remote=FAST) as ckpt:
        assert ckpt.fetch_stats.retries == 2
        assert ckpt.read("a").tolist() == list(range(10))


def test_persistent_5xx_gives_up_naming_the_url(server):
    server.faults[SHARD] += ["500"] * 10
    with pytest.raises(
        CheckpointError, match=rf"{server.url}{SHARD}: giving up after 4 attempts \(HTTP 500\)"
    ):
        open_checkpoint(f"{server.url}/single", remote=FAST)


def test_wrong_content_range_is_an_error_naming_the_url(server):
    server.faults[SHARD] += ["bad-range"]
    with pytest.raises(
        CheckpointError, match=rf"{server.url}{SHARD}: asked for bytes 0-65535, got Content-Range"
    ):
        open_checkpoint(f"{server.url}/single", remote=FAST)


def test_server_ignoring_range_is_an_error(server):
    server.faults[SHARD] += ["ignore-range"]
    with pytest.raises(CheckpointError, match=rf"{server.url}{SHARD}: the server ignored the Range request"):
        open_checkpoint(f"{server.url}/single", remote=FAST)


def test_fault_during_a_tensor_read(root, server):
    options = RemoteOptions(backoff=0.001, first_read=1024, block_size=4096)
    name = "language_model.model.embed_tokens.weight"
    with (
        open_checkpoint(root / "tiny") as local,
        open_checkpoint(f"{server.url}/tiny", remote=options) as ckpt,
    ):
        shard = f"/tiny/{ckpt.info(name).shard}"
        server.faults[shard] += ["500", "drop", "truncate"]
        retries_before = ckpt.fetch_stats.retries
        assert same(ckpt.read(name), local.read(name))
        assert server.faults[shard] == []  # all three planted faults were met ...
        # ... and each cost one retry. (At least: under heavy CPU load an unplanned transient error was
        # seen once in many runs, and retried as designed; the exact count holds in the serial tests above.)
        assert ckpt.fetch_stats.retries - retries_before >= 3
        server.faults[shard] += ["bad-range"]
        with pytest.raises(CheckpointError, match=rf"{server.url}{shard}: asked for bytes"):
            ckpt.read(name)


def test_connection_refused(server):
    url = server.url
    server.shutdown()
    server.server_close()
    with pytest.raises(CheckpointError, match=rf"{url}/single/.*giving up after 2 attempts \(ConnectError"):
        open_checkpoint(f"{url}/single", remote=RemoteOptions(retries=1, backoff=0.001))
