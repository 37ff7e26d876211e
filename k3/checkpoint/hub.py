"""Hugging Face Hub sources, read through huggingface_hub: `hf://ORG/REPO[@REVISION]` and
`https://huggingface.co/ORG/REPO/resolve/REVISION[/FILE]` (or the same under `HF_ENDPOINT`).

    ref = parse_hub_source("hf://inference-optimization/Kimi-K3-0.40B@main")
    hub = HubClient(ref, RemoteOptions())     # the revision resolved once: hub.commit (40 hex)
    hub.url("model.safetensors")              # .../resolve/<commit>/model.safetensors

`HubClient` is the `HttpClient` the checkpoint reader uses for Hub sources: the revision is resolved once
(`HfApi.model_info`, the Hub's revision API) to a commit hash, and every later request names that commit.
Requests go through huggingface_hub's own HTTP session: its headers (`HF_TOKEN` or the `hf auth login`
token, `HF_HUB_DISABLE_IMPLICIT_TOKEN`), and its client, which follows the Hub's 302 to the CDN and drops
`Authorization` on a redirect to another host: the token reaches the Hub host only. Safetensors files are
read by `Range` requests on the resolve URL (a fresh redirect each time: signed CDN URLs are bound to
their range and expire); each answer must be 206 with exactly the bytes asked, the redirect's
`X-Repo-Commit` the resolved commit and its `X-Linked-Size` the file's size. Files already in the local
Hugging Face cache at that commit are read from there (`local_file`).

Every failure is one line naming the URL and the HTTP status: a missing repository, revision or file
(404 + X-Error-Code), a gated repo or bad token (401/403), a revision that moved under a pinned commit,
a short or wrong-range answer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from k3.checkpoint.remote import (
    BlockCache,
    FetchStats,
    HttpClient,
    RemoteNotFound,
    RemoteOptions,
    _Retryable,
)
from k3.checkpoint.source import CheckpointError

HF_SCHEME = "hf://"
DEFAULT_ENDPOINT = "https://huggingface.co"
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO = r"[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*"
_HF = re.compile(rf"hf://(?P<repo>{_REPO})(?:@(?P<rev>[^/]+))?(?:/(?P<file>.+))?")
_RESOLVE = re.compile(rf"(?P<repo>{_REPO})(?:/resolve/(?P<rev>[^/]+)(?:/(?P<file>.+))?)?/?")
_STATUS_WORDS = {
    "RepoNotFound": "repository not found",
    "RevisionNotFound": "revision not found",
    "EntryNotFound": "file not found",
    "GatedRepo": "gated repository: accept its conditions on the Hub and use a token that has access",
}


def endpoint() -> str:
    """The Hub's base URL: `HF_ENDPOINT` (a mirror, a test server) or huggingface.co, read on each call."""
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def hub_cache() -> str:
    """The local Hugging Face cache: `HF_HUB_CACHE`, else `HF_HOME`/hub, read on each call (huggingface_hub
    reads them once, at import), else huggingface_hub's default."""
    from huggingface_hub import constants

    if found := os.environ.get("HF_HUB_CACHE"):
        return found
    if home := os.environ.get("HF_HOME"):
        return os.path.join(home, "hub")
    return constants.HF_HUB_CACHE


@dataclass(frozen=True)
class HubRef:
    repo_id: str  # ORG/REPO
    revision: str  # as asked: a branch, a tag or a 40-hex commit ("main" when none was given)
    file: str | None = None  # one file of the repo named by the source (a `.safetensors` shard)

    @property
    def pinned(self) -> bool:
        return _COMMIT.fullmatch(self.revision) is not None

    def source(self, commit: str | None = None) -> str:
        """`hf://ORG/REPO@REV[/FILE]`: with `commit`, the pinned form every output records."""
        tail = f"/{self.file}" if self.file else ""
        return f"{HF_SCHEME}{self.repo_id}@{commit or self.revision}{tail}"


def parse_hub_source(source: str | Path) -> HubRef | None:
    """The Hub reference of `source`, or None when it is not a Hub source (a folder, a plain URL)."""
    if not isinstance(source, str):
        return None
    if source.startswith(HF_SCHEME):
        m = _HF.fullmatch(source.rstrip("/"))
        if m is None:
            raise CheckpointError(f"{source}: not a Hub source (expected hf://ORG/REPO[@REVISION][/FILE])")
        return HubRef(m["repo"], m["rev"] or "main", m["file"])
    for base in {endpoint(), DEFAULT_ENDPOINT}:
        if source.startswith(base + "/"):
            m = _RESOLVE.fullmatch(source[len(base) + 1 :])
            if m is None:
                raise CheckpointError(f"{source}: not a Hub URL (expected {base}/ORG/REPO/resolve/REV/FILE)")
            return HubRef(m["repo"], m["rev"] or "main", m["file"])
    return None


def hub_failure(url: str, status: int, error_code: str | None) -> CheckpointError:
    """The one-line error of a failed Hub answer."""
    if status == 404 and error_code == "EntryNotFound":
        return RemoteNotFound(url)
    if status == 404:
        return CheckpointError(f"{url}: {_STATUS_WORDS.get(error_code or '', 'not found')} (HTTP 404)")
    if status == 401:
        what = (
            _STATUS_WORDS["GatedRepo"]
            if error_code == "GatedRepo"
            else "private, gated or missing repository"
        )
        return CheckpointError(f"{url}: unauthorized, {what}; set HF_TOKEN or run `hf auth login` (HTTP 401)")
    if status == 403:
        return CheckpointError(f"{url}: forbidden, the token has no access to this repository (HTTP 403)")
    return CheckpointError(f"{url}: HTTP {status}")


class HubClient(HttpClient):
    """An `HttpClient` for one Hub repository at one commit, over huggingface_hub's session."""

    def __init__(self, ref: HubRef, options: RemoteOptions):
        import httpx2
        from huggingface_hub.utils import get_session

        self.transport_errors = (httpx2.TransportError,)  # huggingface_hub 2.x's client: retried as usual
        self.options, self.ref, self.endpoint = options, ref, endpoint()
        self.stats = FetchStats()
        self.cache = BlockCache(options.cache_dir, options.cache_max_bytes) if options.cache_dir else None
        self._client = get_session()  # shared by huggingface_hub: never closed here
        self.commit, self.files = self._resolve()

    def close(self) -> None:
        """The session belongs to huggingface_hub."""

    @property
    def location(self) -> str:
        return self.ref.source(self.commit)

    def url(self, name: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.ref.repo_id, name, revision=self.commit, endpoint=self.endpoint)

    def _headers(self, **extra: str) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        return {**build_hf_headers(library_name="k3"), "Accept-Encoding": "identity", **extra}

    def _resolve(self) -> tuple[str, set[str]]:
        """(commit, file names) of the revision asked: one call to the Hub's revision API."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        api_url = f"{self.endpoint}/api/models/{self.ref.repo_id}/revision/{self.ref.revision}"
        self.stats.count(requests=1)
        try:
            info = HfApi(endpoint=self.endpoint, library_name="k3").model_info(
                self.ref.repo_id, revision=self.ref.revision, timeout=self.options.timeout
            )
        except HfHubHTTPError as e:
            response = e.response
            raise hub_failure(api_url, response.status_code, response.headers.get("X-Error-Code")) from None
        except (OSError, *self.transport_errors) as e:  # refused, unreachable
            raise CheckpointError(f"{api_url}: {type(e).__name__}: {e}") from None
        commit = info.sha or ""
        if not _COMMIT.fullmatch(commit):
            raise CheckpointError(
                f"{api_url}: the Hub gave no commit hash for revision {self.ref.revision!r}"
            )
        if self.ref.pinned and commit != self.ref.revision:
            raise CheckpointError(
                f"{api_url}: revision {self.ref.revision} is now commit {commit} (HTTP 200)"
            )
        return commit, {s.rfilename for s in info.siblings or []}

    def local_file(self, name: str) -> Path | None:
        """The file from the local Hugging Face cache at the resolved commit, if it is there."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.ref.repo_id, name, cache_dir=hub_cache(), revision=self.commit)
        return Path(found) if isinstance(found, str) and Path(found).is_file() else None

    def _check_status(self, response, url: str, expected: int) -> None:  # noqa: ANN001 (an httpx2 response)
        """Status, then the redirect's promises: the resolved commit, and (later) the linked size."""
        for hop in [*response.history, response]:
            commit = hop.headers.get("X-Repo-Commit")
            if commit is not None and commit != self.commit:
                raise CheckpointError(
                    f"{url}: the revision moved: resolved to {self.commit}, the Hub now answers commit "
                    f"{commit} (HTTP {hop.status_code})"
                )
        status = response.status_code
        if status == expected:
            return
        if status >= 500 or status == 429:
            raise _Retryable(f"HTTP {status}")
        if status == 200 and expected == 206:
            raise CheckpointError(f"{url}: the server ignored the Range request (HTTP 200, expected 206)")
        raise hub_failure(url, status, response.headers.get("X-Error-Code"))

    def get_range(self, url: str, offset: int, length: int) -> tuple[bytes | bytearray, int]:
        """(bytes [offset, offset + length), file size): one ranged GET on the resolve URL, redirected."""
        headers = self._headers(Range=f"bytes={offset}-{offset + length - 1}")

        def attempt() -> tuple[bytes | bytearray, int]:
            self.stats.count(requests=1)
            with self._client.stream("GET", url, headers=headers, timeout=self.options.timeout) as r:
                self._check_status(r, url, 206)
                where = f"{url} (via {r.url.host})" if r.history else url
                body, size = self._partial_content(r, where, offset, length, note=" (HTTP 206)")
                linked = next(
                    (h.headers["X-Linked-Size"] for h in r.history if "X-Linked-Size" in h.headers), None
                )
                if linked is not None and int(linked) != size:
                    raise CheckpointError(
                        f"{where}: X-Linked-Size {linked} but Content-Range says {size} (HTTP 206)"
                    )
                return body, size

        return self._with_retries(url, attempt)
