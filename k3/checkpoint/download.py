"""`k3 download hf://ORG/REPO[@REVISION] [--include PATTERN] [--local-dir DIR]`: the files, for those who
want them on disk, by huggingface_hub's own download (resumable: a partial file is continued with Range),
each LFS file then checked against the sha256 the Hub states for it.

Files go to the Hugging Face cache (where `hf://` sources then read them from, without a request for their
bytes) or to `--local-dir`. The revision is resolved once: every file comes from the same commit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def download(
    source: str, include: list[str] | None = None, local_dir: Path | None = None
) -> tuple[str, Path]:
    """Download `source`'s files (those matching any `include` glob; all without one). Returns (the
    resolved `hf://ORG/REPO@<commit>`, the folder holding the files)."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    ref = parse_hub_source(source)
    if ref is None:
        raise CheckpointError(f"{source}: not a Hub source (expected hf://ORG/REPO[@REVISION])")
    hub = HubClient(ref, RemoteOptions())
    patterns = include or ([ref.file] if ref.file else None)
    try:
        folder = snapshot_download(
            ref.repo_id,
            revision=hub.commit,
            allow_patterns=patterns,
            local_dir=local_dir,
            cache_dir=hub_cache(),
            endpoint=hub.endpoint,
            library_name="k3",
        )
        tree = HfApi(endpoint=hub.endpoint, library_name="k3").list_repo_tree(
            ref.repo_id, revision=hub.commit, recursive=True
        )
        stated = {f.path: f.lfs.sha256 for f in tree if isinstance(f, RepoFile) and f.lfs is not None}
    except HfHubHTTPError as e:
        response = e.response
        raise hub_failure(
            str(response.url), response.status_code, response.headers.get("X-Error-Code")
        ) from None
    except OSError as e:
        raise CheckpointError(f"{hub.location}: download failed ({type(e).__name__}: {e})") from None
    wanted = set(filter_repo_objects(list(stated), allow_patterns=patterns))
    for name in sorted(wanted):
        path = Path(folder) / name
        if not path.is_file():
            raise CheckpointError(f"{hub.url(name)}: not downloaded")
        if (found := sha256_of(path)) != stated[name]:
            path.unlink()  # never leave a corrupt copy where a reader would take it
            raise CheckpointError(
                f"{hub.url(name)}: sha256 {found} of the downloaded file, the Hub states {stated[name]}"
            )
    return hub.location, Path(folder)
