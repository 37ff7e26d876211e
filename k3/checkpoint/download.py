"""`k3 download hf://ORG/REPO[@REVISION] [--include PATTERN] [--local-dir DIR]`: the files, for those who
want them on disk, each LFS file checked against the sha256 the Hub states for it.

Resumable after a kill, SIGKILL included. huggingface_hub (2.x) downloads each file into a temporary file of
its own process and deletes or abandons it when the process ends, so a killed download of a 5 GB shard
starts again from nothing. k3 therefore fetches the LFS files itself, through huggingface_hub's own
`http_get` and headers: into a partial file that outlives the process (`DIR/.cache/k3/NAME.part`, or beside
the cache's blobs), continued by a Range request from its length, checked by sha256, then moved into place
(one rename). `snapshot_download` then fetches the small files and finds the large ones there (in the
cache it links the blob; in a local dir it hashes the file once more before taking it).

Files go to the Hugging Face cache (where `hf://` sources then read them from, without a request for their
bytes) or to `--local-dir`. The revision is resolved once: every file comes from the same commit.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import urlsplit

from k3.checkpoint.hub import HubClient, hub_cache, hub_failure, parse_hub_source
from k3.checkpoint.remote import RemoteOptions
from k3.checkpoint.source import CheckpointError

_CHUNK = 8 * 2**20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, stated: str, url: str) -> None:
    """Raise CheckpointError, having deleted `path`, unless its bytes hash to `stated`: a corrupt copy is
    never left where a reader would take it, nor a partial file a later run would continue from."""
    if (found := sha256_of(path)) != stated:
        path.unlink()
        raise CheckpointError(f"{url}: sha256 {found} of the downloaded file, the Hub states {stated}")


def fetch_resumably(url: str, size: int, sha256: str, target: Path, partial: Path) -> None:
    """`url`'s bytes into `target` by way of `partial`, continued from its length when a run before left
    it; raises CheckpointError (and drops the partial file) when the whole does not hash to `sha256`."""
    from huggingface_hub import get_hf_file_metadata
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(library_name="k3")
    location = get_hf_file_metadata(url, headers=headers).location  # the CDN's URL, after the Hub's redirect
    if urlsplit(location).netloc != urlsplit(url).netloc:
        headers.pop("authorization", None)  # the token goes to the Hub's host only
    partial.parent.mkdir(parents=True, exist_ok=True)
    with open(partial, "r+b" if partial.exists() else "wb") as f:
        have = f.seek(0, os.SEEK_END)
        if have > size:  # not a prefix of this file: start again
            f.truncate(have := 0)
            f.seek(0)
        http_get(
            location, f, resume_size=have, headers=headers, expected_size=size, displayed_filename=target.name
        )
    check_sha256(partial, sha256, url)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(partial, target)


def download(
    source: str, include: list[str] | None = None, local_dir: Path | None = None
) -> tuple[str, Path]:
    """Download `source`'s files (those matching any `include` glob; all without one). Returns (the
    resolved `hf://ORG/REPO@<commit>`, the folder holding the files)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    ref = parse_hub_source(source)
    if ref is None:
        raise CheckpointError(f"{source}: not a Hub source (expected hf://ORG/REPO[@REVISION])")
    hub = HubClient(ref, RemoteOptions())
    patterns = include or ([ref.file] if ref.file else None)
    blobs = Path(hub_cache()) / repo_folder_name(repo_id=ref.repo_id, repo_type="model") / "blobs"
    verified: set[str] = set()
    try:
        tree = HfApi(endpoint=hub.endpoint, library_name="k3").list_repo_tree(
            ref.repo_id, revision=hub.commit, recursive=True
        )
        files = [f for f in tree if isinstance(f, RepoFile)]
        lfs = {f.path: f for f in files if f.lfs is not None}
        if patterns and not list(filter_repo_objects([f.path for f in files], allow_patterns=patterns)):
            names = ", ".join(sorted(f.path for f in files)[:8])
            raise CheckpointError(f"{hub.location}: no file matches {' or '.join(patterns)} (it has {names})")
        wanted = set(filter_repo_objects(list(lfs), allow_patterns=patterns))
        for name in sorted(wanted):
            sha256 = lfs[name].lfs.sha256
            if local_dir is not None:
                target, partial = Path(local_dir) / name, Path(local_dir) / ".cache" / "k3" / f"{name}.part"
            else:
                target, partial = blobs / sha256, blobs / f"{sha256}.k3.incomplete"
            if not target.exists():
                fetch_resumably(hub.url(name), lfs[name].size, sha256, target, partial)
                verified.add(name)
        folder = snapshot_download(
            ref.repo_id,
            revision=hub.commit,
            allow_patterns=patterns,
            local_dir=local_dir,
            cache_dir=hub_cache(),
            endpoint=hub.endpoint,
            library_name="k3",
        )
    except HfHubHTTPError as e:
        response = e.response
        raise hub_failure(
            str(response.url), response.status_code, response.headers.get("X-Error-Code")
        ) from None
    except OSError as e:
        raise CheckpointError(f"{hub.location}: download failed ({type(e).__name__}: {e})") from None
    for name in sorted(wanted - verified):  # files that were there before: checked here
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{hub.url(name)}: not downloaded")
        check_sha256(path, lfs[name].lfs.sha256, hub.url(name))
    return hub.location, Path(folder)
