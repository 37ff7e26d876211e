"""Open a checkpoint (a directory or an http(s) URL of one) and read its tensors.

A checkpoint is either `model.safetensors.index.json` + the shards it names, or one `model.safetensors`
(a local directory may also hold other `*.safetensors` files without an index). `config.json` is optional:
without it, or when it is not a K3-family config, `config` is None and `config_error` says why.

Opening reads and validates every shard header and the index against them, and nothing else: tensor data
is read on demand, zero-copy from a memory map locally and by HTTP ranges remotely.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import torch

from k3.checkpoint.header import TensorInfo, load_json_object, parse_header
from k3.checkpoint.hub import HF_SCHEME, HubClient, HubRef, parse_hub_source
from k3.checkpoint.mirror import MirroredSource
from k3.checkpoint.quant import with_header_packing
from k3.checkpoint.remote import FetchStats, HttpClient, HttpSource, RemoteNotFound, RemoteOptions
from k3.checkpoint.source import ByteSource, CheckpointError, LocalSource
from k3.checkpoint.traps import config_traps
from k3.config import ConfigError, K3Config

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
ADDED_TOKENS_NAME = "added_tokens.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# A shard named by an index must be a plain file name next to it: no directories, no "..".
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\.safetensors")

TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}


def tensor_from_bytes(buf: memoryview | bytearray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `buf` without copying, unless the bytes are misaligned for the dtype (a tensor
    following an odd-sized U8 tensor, say): then one aligned copy, since kernels may assume alignment.
    BOOL is always copied, as `!= 0` of the bytes."""
    torch_dtype = TORCH_DTYPES[dtype]
    if len(buf) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # [nbytes], shares memory with buf
    if torch_dtype is torch.bool:  # a byte other than 0/1 is not a valid torch bool: normalize (a copy)
        return (flat != 0).view(shape)
    if flat.data_ptr() % torch_dtype.itemsize:
        flat = flat.clone()
    return flat.view(torch_dtype).view(shape)


class Checkpoint:
    """The tensors of a checkpoint, indexed from its headers. Use as a context manager, or call close()."""

    def __init__(
        self,
        location: str,
        sources: dict[str, ByteSource],
        *,
        weight_map: dict[str, str] | None = None,
        index_metadata: dict[str, Any] | None = None,
        raw_config: dict[str, Any] | None = None,
        config_error: str | None = None,
        http: HttpClient | None = None,
        findings: list[str] | None = None,
        workers: int = 1,
    ):
        """`sources`: shard name -> source, in shard order (they are owned, and closed, from here on).
        `workers`: headers read at once (remote shards: each header is one or two round trips)."""
        self.location = location
        self.revision: str | None = None  # the commit hash a Hub source was resolved to
        self.added_tokens: dict[str, int] | None = None  # added_tokens.json, where there is one
        self._sources = sources
        self._http = http
        self._closed = False
        self.metadata: dict[str, dict[str, str]] = {}  # shard -> its __metadata__
        self.findings: list[str] = list(findings or [])  # oddities that do not stop reading
        self._tensors: dict[str, TensorInfo] = {}
        try:
            self._index(weight_map, index_metadata, workers)
        except BaseException:
            self.close()
            raise
        self.raw_config = raw_config
        self.config: K3Config | None = None
        self.config_error = config_error
        if raw_config is not None:
            try:
                headers = {t.name: (t.dtype, t.shape) for t in self._tensors.values()}
                self.config = with_header_packing(K3Config.from_dict(raw_config), headers, location)
            except CheckpointError as e:  # packed tensors the config cannot account for
                self.config_error = str(e)
            except ConfigError as e:
                self.config_error = f"{CONFIG_NAME} is not a K3-family config: {e}"
            except (TypeError, KeyError, AttributeError) as e:  # a value of the wrong JSON type, deep down
                self.config_error = f"{CONFIG_NAME} is not a K3-family config: {type(e).__name__}: {e}"

    def _index(
        self, weight_map: dict[str, str] | None, index_metadata: dict[str, Any] | None, workers: int
    ) -> None:
        index = f"{self.location}/{INDEX_NAME}"
        with ThreadPoolExecutor(max(workers, 1)) as pool:
            headers = list(pool.map(parse_header, self._sources.values(), self._sources))
        for (shard, source), header in zip(self._sources.items(), headers, strict=True):
            self.metadata[shard] = header.metadata
            for t in header.tensors:
                if t.name in self._tensors:
                    raise CheckpointError(
                        f"{source.name}: tensor {t.name!r} is also in {self._tensors[t.name].shard}"
                    )
                if weight_map is not None and weight_map.get(t.name) != shard:
                    where = f"maps it to {weight_map[t.name]}" if t.name in weight_map else "does not list it"
                    raise CheckpointError(
                        f"{source.name}: tensor {t.name!r} is in this shard but {index} {where}"
                    )
                self._tensors[t.name] = t
        for name, shard in (weight_map or {}).items():
            if name not in self._tensors:
                raise CheckpointError(
                    f"{index}: tensor {name!r} is mapped to {shard}, which does not hold it"
                )
        declared = (index_metadata or {}).get("total_size")
        if declared is not None and declared != self.total_bytes:
            self.findings.append(
                f"{INDEX_NAME} declares total_size {declared}, "
                f"the shards hold {self.total_bytes} bytes of tensors"
            )

    @property
    def traps(self) -> list[str]:
        """The traps of the config and the files (k3.checkpoint.traps), one line each."""
        headers = {t.name: (t.dtype, t.shape) for t in self._tensors.values()}
        return config_traps(self.raw_config, headers, self.added_tokens)

    # ---- the index ----------------------------------------------------------------------------------------
    def tensors(self) -> Iterator[TensorInfo]:
        """Every tensor in file order: shard order, then offset."""
        return iter(self._tensors.values())

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.location}: no tensor {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def shards(self) -> list[str]:
        return list(self._sources)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    @property
    def total_tensors(self) -> int:
        return len(self._tensors)

    @property
    def fetch_stats(self) -> FetchStats | None:
        """Requests and bytes fetched so far (remote checkpoints only)."""
        return self._http.stats if self._http is not None else None

    # ---- the data -----------------------------------------------------------------------------------------
    def _source(self, t: TensorInfo) -> ByteSource:
        if self._closed:
            raise CheckpointError(f"{self.location}: checkpoint is closed (reading tensor {t.name!r})")
        return self._sources[t.shard]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor: zero-copy over the memory map locally, fetched remotely.

        Locally the tensor shares the mapping's pages (copy-on-write): an in-place change never reaches the
        file, but later reads of the same tensor from this Checkpoint object see it; clone() to keep apart.
        """
        t = self.info(name)
        return tensor_from_bytes(self._source(t).read(t.start, t.nbytes), t.dtype, t.shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of the first dimension, reading only their bytes."""
        t = self.info(name)
        if not t.shape:
            raise CheckpointError(f"{self.location}: tensor {name!r} is a scalar; it has no rows")
        rows = t.shape[0]
        if not 0 <= start <= stop <= rows:
            raise CheckpointError(
                f"{self.location}: tensor {name!r} has {rows} rows; cannot read [{start}, {stop})"
            )
        row_bytes = t.nbytes // rows if rows else 0
        buf = self._source(t).read(t.start + start * row_bytes, (stop - start) * row_bytes)
        return tensor_from_bytes(buf, t.dtype, (stop - start, *t.shape[1:]))

    def prefetch(self, names: list[str]) -> int:
        """Fetch the bytes of these tensors into a mirrored checkpoint's local files at once (the missing
        parts as maximal runs, in file order, a few requests in parallel): what `read` would fetch one
        tensor at a time. Returns the bytes fetched; 0 for a checkpoint that is not mirrored."""
        by_shard: dict[str, list[tuple[int, int]]] = {}
        for name in names:
            t = self.info(name)
            by_shard.setdefault(t.shard, []).append((t.start, t.end))
        if self._closed:
            raise CheckpointError(f"{self.location}: checkpoint is closed (prefetching)")
        fetched = 0
        for shard, ranges in by_shard.items():
            source = self._sources[shard]
            if isinstance(source, MirroredSource):
                fetched += source.fetch(ranges)
        return fetched

    def read_span(self, shard: str, start: int, stop: int) -> bytearray:
        """Bytes [start, stop) of a shard file in a buffer of the caller's: one `preadv` locally (nothing
        stays mapped), one ranged request remotely. For readers that stream a checkpoint through memory."""
        if shard not in self._sources:
            raise CheckpointError(f"{self.location}: no shard {shard!r}")
        if self._closed:
            raise CheckpointError(f"{self.location}: checkpoint is closed (reading {shard})")
        return self._sources[shard].read_owned(start, stop - start)

    def map_span(self, shard: str, start: int, stop: int) -> memoryview:
        """Bytes [start, stop) of a local shard as a view of its memory map, read into the page cache and
        mapped now (no copy); `unmap_span` gives the pages back. For readers that stream a local
        checkpoint."""
        return self._local(shard).populate(start, stop - start)

    def unmap_span(self, shard: str, start: int, stop: int) -> None:
        self._local(shard).unmap(start, stop - start)

    def _local(self, shard: str) -> LocalSource:
        source = self._sources.get(shard)
        if self._closed or not isinstance(source, LocalSource):
            raise CheckpointError(f"{self.location}: {shard!r} is not an open local shard")
        return source

    # ---- lifetime -----------------------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        for source in self._sources.values():
            source.close()
        if self._http is not None:
            self._http.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpoint({self.location!r}, {self.total_tensors} tensors, {self.total_bytes:,} bytes, "
            f"{len(self._sources)} shard(s))"
        )


# ---- opening --------------------------------------------------------------------------------------------
def is_url(source: str | Path) -> bool:
    """A remote source: an http(s) URL or a Hub source (`hf://ORG/REPO[@REVISION]`)."""
    return isinstance(source, str) and source.startswith(("http://", "https://", HF_SCHEME))


def open_checkpoint(
    source: str | Path, *, remote: RemoteOptions | None = None, mirror: Path | None = None
) -> Checkpoint:
    """Open a checkpoint directory, a single `.safetensors` file, or an http(s) URL of either.

    Raises CheckpointError when the checkpoint is missing, unsafe (pickle-only) or malformed.
    `remote` tunes HTTP reading (block size, parallelism, retries, cache directory). `mirror` (URLs only):
    every shard is mirrored into a sparse file in that folder (`k3.checkpoint.mirror`), so `read` returns
    tensors memory-mapped from local disk instead of fetched into anonymous memory.
    """
    hub = parse_hub_source(source)
    if hub is not None:
        return _open_hub(hub, remote or RemoteOptions(), mirror)
    if is_url(source):
        return _open_remote(str(source), remote or RemoteOptions(), mirror)
    return _open_local(Path(source))


def _parse_index(data: bytes, where: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(weight_map, metadata) of a `model.safetensors.index.json`, validated."""
    index = load_json_object(data, where)
    weight_map, metadata = index.get("weight_map"), index.get("metadata", {})
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where}: no 'weight_map' object")
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{where}: 'metadata' is not an object")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _SHARD_NAME.fullmatch(shard):
            raise CheckpointError(
                f"{where}: tensor {name!r} maps to {shard!r}, not a plain *.safetensors file name"
            )
    return weight_map, metadata


def _shard_order(weight_map: dict[str, str]) -> list[str]:
    return sorted(set(weight_map.values()))


def _parse_config(data: bytes | None, where: str) -> tuple[dict[str, Any] | None, str | None]:
    """(raw config, why there is none): a broken config.json does not stop the tensors being read."""
    if data is None:
        return None, f"no {CONFIG_NAME}"
    try:
        return load_json_object(data, where), None
    except CheckpointError as e:
        return None, str(e)


def _parse_added_tokens(data: bytes | bytearray | None, where: str) -> dict[str, int] | None:
    """added_tokens.json ({token: id}), None when absent or not such an object (it is only reported)."""
    if data is None:
        return None
    try:
        found = load_json_object(bytes(data), where)
    except CheckpointError:
        return None
    return {k: v for k, v in found.items() if isinstance(v, int)}


def _refuse_pickle(directory: Path) -> None:
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{directory}: holds only pickle-based weights ({', '.join(pickles[:3])}); k3 never unpickles "
            "(loading a pickle can run arbitrary code): convert the checkpoint to safetensors first"
        )


def _open_local(path: Path) -> Checkpoint:
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    weight_map: dict[str, str] | None = None
    index_metadata: dict[str, Any] | None = None
    findings: list[str] = []
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(
                f"{path}: a pickle-based checkpoint; k3 never unpickles: convert it to safetensors"
            )
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: not a checkpoint directory or a .safetensors file")
        directory, shard_names = path.parent, [path.name]
    else:
        directory = path
        index_path = directory / INDEX_NAME
        if index_path.is_file():
            weight_map, index_metadata = _parse_index(index_path.read_bytes(), str(index_path))
            shard_names = _shard_order(weight_map)
            for shard in shard_names:
                if not (directory / shard).is_file():
                    first = next(name for name, s in weight_map.items() if s == shard)
                    raise CheckpointError(
                        f"{index_path}: shard {shard} (holding tensor {first!r}) is missing"
                    )
            strays = sorted({p.name for p in directory.glob("*.safetensors")} - set(shard_names))
            if strays:
                findings.append(
                    f"{len(strays)} *.safetensors file(s) not named by {INDEX_NAME}: {', '.join(strays[:5])}"
                )
        elif (directory / SINGLE_NAME).is_file():
            shard_names = [SINGLE_NAME]
        else:
            shard_names = sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
            if not shard_names:
                _refuse_pickle(directory)
                raise CheckpointError(
                    f"{directory}: no {INDEX_NAME}, {SINGLE_NAME} or other *.safetensors file"
                )
    config_path = directory / CONFIG_NAME
    raw_config, config_error = _parse_config(
        config_path.read_bytes() if config_path.is_file() else None, str(config_path)
    )
    sources: dict[str, ByteSource] = {}
    try:
        for shard in shard_names:
            sources[shard] = LocalSource(directory / shard)
    except OSError as e:
        for s in sources.values():
            s.close()
        raise CheckpointError(f"{directory / shard}: cannot open ({e.strerror})") from None
    ckpt = Checkpoint(
        str(path),
        sources,
        weight_map=weight_map,
        index_metadata=index_metadata,
        raw_config=raw_config,
        config_error=config_error,
        findings=findings,
    )
    added = directory / ADDED_TOKENS_NAME
    ckpt.added_tokens = _parse_added_tokens(added.read_bytes() if added.is_file() else None, str(added))
    return ckpt


def _open_remote(url: str, options: RemoteOptions, mirror: Path | None) -> Checkpoint:
    http = HttpClient(options)
    try:
        if url.endswith(".safetensors"):
            base, shard_names = url.rsplit("/", 1)[0] + "/", [url.rsplit("/", 1)[1]]
            index_data = None
        else:
            base = url if url.endswith("/") else url + "/"
            index_data = http.get(base + INDEX_NAME)
            shard_names = [SINGLE_NAME]
        weight_map: dict[str, str] | None = None
        index_metadata: dict[str, Any] | None = None
        if index_data is not None:
            weight_map, index_metadata = _parse_index(index_data, base + INDEX_NAME)
            shard_names = _shard_order(weight_map)
        raw_config, config_error = _parse_config(http.get(base + CONFIG_NAME), base + CONFIG_NAME)
        urls = {base + quote(shard): shard for shard in shard_names}
        try:  # each source fetches its first range on creation: a few at once
            with ThreadPoolExecutor(options.parallel) as pool:
                opened = list(pool.map(lambda shard_url: HttpSource(shard_url, http), urls))
        except RemoteNotFound as e:
            if url.endswith(".safetensors"):
                raise
            if index_data is None:
                raise CheckpointError(f"{url}: no {INDEX_NAME} or {SINGLE_NAME} there (HTTP 404)") from None
            shard = urls[e.url]
            raise CheckpointError(f"{base + INDEX_NAME}: shard {shard} is missing (HTTP 404)") from None
        sources: dict[str, ByteSource] = dict(zip(shard_names, opened, strict=True))
        if mirror is not None:  # the same sources, read through local sparse files
            sources = {
                shard: MirroredSource(s, mirror, parallel=options.parallel)
                for shard, s in zip(shard_names, opened, strict=True)
            }
    except BaseException:
        http.close()
        raise
    return Checkpoint(
        url.rstrip("/"),
        sources,
        weight_map=weight_map,
        index_metadata=index_metadata,
        raw_config=raw_config,
        config_error=config_error,
        http=http,
        workers=options.parallel,
    )


def _open_hub(ref: HubRef, options: RemoteOptions, mirror: Path | None) -> Checkpoint:
    """A Hub repository at one commit: files in the local Hugging Face cache are read from there, the rest
    by ranged requests through huggingface_hub (`k3.checkpoint.hub`). No safetensors file is downloaded."""
    hub = HubClient(ref, options)
    try:
        location = hub.location

        def small(name: str) -> bytes | bytearray | None:
            if name not in hub.files:
                return None
            cached = hub.local_file(name)
            return cached.read_bytes() if cached is not None else hub.get(hub.url(name))

        weight_map: dict[str, str] | None = None
        index_metadata: dict[str, Any] | None = None
        if ref.file is not None:
            if ref.file not in hub.files:
                raise CheckpointError(f"{hub.url(ref.file)}: file not found in {location} (HTTP 404)")
            shard_names = [ref.file]
        elif INDEX_NAME in hub.files:
            weight_map, index_metadata = _parse_index(small(INDEX_NAME) or b"", f"{location}/{INDEX_NAME}")
            shard_names = _shard_order(weight_map)
            if missing := [s for s in shard_names if s not in hub.files]:
                raise CheckpointError(f"{location}/{INDEX_NAME}: shard {missing[0]} is missing (HTTP 404)")
        elif SINGLE_NAME in hub.files:
            shard_names = [SINGLE_NAME]
        else:
            pickles = sorted(f for f in hub.files if f.endswith(PICKLE_SUFFIXES))
            why = (
                f"only pickle-based weights ({', '.join(pickles[:3])}), never unpickled"
                if pickles
                else "none"
            )
            raise CheckpointError(f"{location}: no {INDEX_NAME} or {SINGLE_NAME} ({why})")
        raw_config, config_error = _parse_config(small(CONFIG_NAME), f"{location}/{CONFIG_NAME}")

        def source(shard: str) -> ByteSource:
            cached = hub.local_file(shard)
            if cached is not None:
                return LocalSource(cached)
            remote_source = HttpSource(hub.url(shard), hub)
            return (
                MirroredSource(remote_source, mirror, parallel=options.parallel) if mirror else remote_source
            )

        with ThreadPoolExecutor(options.parallel) as pool:  # each remote source fetches its first range
            sources: dict[str, ByteSource] = dict(
                zip(shard_names, pool.map(source, shard_names), strict=True)
            )
    except BaseException:
        hub.close()
        raise
    ckpt = Checkpoint(
        location,
        sources,
        weight_map=weight_map,
        index_metadata=index_metadata,
        raw_config=raw_config,
        config_error=config_error,
        http=hub,
        workers=options.parallel,
    )
    ckpt.revision = hub.commit
    try:
        ckpt.added_tokens = _parse_added_tokens(small(ADDED_TOKENS_NAME), f"{location}/{ADDED_TOKENS_NAME}")
    except BaseException:
        ckpt.close()
        raise
    return ckpt
