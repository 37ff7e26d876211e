"""The prefix cache: sequence states at every `interval`-th token, found again by the ids before them.

While the engine prefills a prompt it cuts it at every multiple of `interval` (its chunks never cross
one, see `Engine.chunk_size`) and stores a **block** per boundary b: the KDA states after position b and
the MLA rows of positions b - interval..b (plus, when the sequence recorded them, the routed experts of
those positions). A block's key is a hash chain: `key = sha256(parent key + the block's ids + which
image rows its pads hold)` (`PromptImages`: the same pads can hold other pixels), the root key naming
the checkpoint and the interval, so a key stands for the whole prefix 0..b and the model that
computed it (vLLM's block hashes). A new prompt walks the chain over its own ids and resumes from the
deepest cached block that leaves at least one prompt token to prefill (its logits give the first token);
the resumed cache is the KDA state of that block and the MLA rows of the chain.

Exact: a block is only ever cut from a batch-1 prefill whose chunks were the engine's standard ones, and
a resumed prefill continues with the same chunks, so every forward after the resume is the very forward
a fresh prefill runs (bit for bit: tests/engine/test_prefix_cache.py). Generated tokens are not cached:
states from one-token decode steps differ in rounding from a prefill's, so the next turn of a chat
prefills the reply again (the blocks of the previous prompt are reused).

Memory: LRU by bytes under `max_bytes`. A block is useless without its ancestors, so evicting one evicts
its cached descendants with it; storing or finding a block refreshes its chain from the deepest block up
to the root (the root ends most recent), so the least recently used block is a leaf. Storing a block
never evicts its own ancestors: under a budget too small for a whole prompt the first blocks stay (the
prefix other prompts most likely share). A block that does not fit is not stored; a full cache never
fails a request.

On disk (`state_dir`): every block is also a safetensors file `<key>.safetensors` (`k3.engine.state_store`:
atomic, format + checkpoint identity + checksum in the metadata), deleted when the block is evicted, read
back by `load_dir` at start. A file of another checkpoint or format, a corrupt or truncated one, or one
whose parent is missing is refused with a log line (and the prefix is recomputed when it is needed).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3.engine import state_store
from k3.errors import K3Error
from k3.model.cache import ModelCache

log = logging.getLogger("k3.prefix_cache")


@dataclass
class Block:
    """The state after position `end` of every prompt whose first `end` ids hash to `key`."""

    key: bytes
    parent: bytes  # the key of the block before (the root key for the first one)
    end: int
    tensors: state_store.Tensors  # kda.* (state after `end`), mla.* rows end-interval..end, tokens, experts?
    media: bytes = b""  # what its image pads hold (PromptImages.media), part of its key

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def experts(self) -> torch.Tensor | None:
        return self.tensors.get("experts")


@dataclass
class Resume:
    """Where a prompt starts: a cache holding its first `tokens` positions (0: nothing cached)."""

    cache: ModelCache
    tokens: int
    key: bytes  # the key of the block at `tokens` (the root key at 0): the next block's parent
    experts: torch.Tensor | None = None  # [tokens, n_moe, k] int64 (asked for and cached)


@dataclass
class Stats:
    hits: int = 0  # lookups that resumed past 0
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled thanks to the cache
    inserted: int = 0
    evicted: int = 0
    refused: list[str] = field(default_factory=list)  # why each refused file was refused


def cached_tokens(per_choice: list[int], prompts: int) -> int:
    """`usage.prompt_tokens_details.cached_tokens` of a request: choices come prompt by prompt (n each);
    each prompt counts once, with the fewest tokens any of its choices restored (n > 1 of a new prompt:
    the first choice computes it, the others reuse it, and the prompt still cost a full prefill)."""
    n = len(per_choice) // prompts if prompts else 0
    return sum(min(per_choice[i * n : (i + 1) * n], default=0) for i in range(prompts))


def block_key(parent: bytes, ids: list[int], media: bytes = b"") -> bytes:
    """A block's key: its parent's, its ids and what its image pads hold (`PromptImages.media`)."""
    return hashlib.sha256(parent + array("i", ids).tobytes() + media).digest()


class PromptImages:
    """A prompt's images as the prefix cache keys them. The same ids can hold other pixels (an image's pads
    are one id repeated), so a block whose positions hold pads takes into its key which rows of which
    images (by content hash) they hold: a prompt with the same images resumes from it, one with others
    does not. Blocks before the first image key as text."""

    def __init__(self, prompt: list[int], pad: int, images: list[tuple[str, int]]) -> None:
        """images: (content hash, pads) of each image, in prompt order."""
        self.positions = [i for i, t in enumerate(prompt) if t == pad]  # where the rows go, in order
        self.images, self.first_rows = images, list(itertools.accumulate((n for _, n in images), initial=0))

    def media(self, start: int, end: int) -> bytes:
        """What the pads of positions [start, end) hold: each image's hash and its rows there."""
        lo, hi = bisect.bisect_left(self.positions, start), bisect.bisect_left(self.positions, end)  # rows
        held = []
        for (key, _), (first, stop) in zip(self.images, itertools.pairwise(self.first_rows), strict=True):
            if first < hi and lo < stop:
                held.append(f"{key}[{max(lo, first) - first}:{min(hi, stop) - first}]")
        return "|".join(held).encode()


class PrefixCache:
    def __init__(self, interval: int, max_bytes: int, identity: str, state_dir: str | Path | None = None):
        if interval < 1:
            raise K3Error(f"--state-interval must be >= 1 token, got {interval}")
        if max_bytes < 0:
            raise K3Error(f"--prefix-cache-bytes must be >= 0, got {max_bytes}")
        self.interval, self.max_bytes = interval, max_bytes
        self.identity = identity
        self.root = self._root()
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.children: dict[bytes, set[bytes]] = {}
        self.bytes = 0
        self.stats = Stats()
        self.state_dir = None if state_dir is None else Path(state_dir)
        if self.state_dir is not None:
            self.load_dir()

    def health(self) -> dict:
        """What the server's /health says of the cache: lookups that resumed (hits) or not (misses), prompt
        tokens not prefilled, blocks stored and evicted, blocks and bytes held, files refused at start."""
        s = self.stats
        return {
            "hits": s.hits,
            "misses": s.misses,
            "cached_tokens": s.cached_tokens,
            "inserted": s.inserted,
            "evicted": s.evicted,
            "blocks": len(self.blocks),
            "bytes": self.bytes,
            "refused_files": len(s.refused),
        }

    # ---- lookups -----------------------------------------------------------------------------------------
    def match(
        self, ids: list[int], limit: int, need_experts: bool = False, images: PromptImages | None = None
    ) -> list[Block]:
        """The cached chain over ids[:limit], deepest last (blocks with experts only, if asked)."""
        chain, key, n = [], self.root, self.interval
        for end in range(n, limit + 1, n):
            key = block_key(key, ids[end - n : end], images.media(end - n, end) if images else b"")
            block = self.blocks.get(key)
            if block is None or (need_experts and block.experts is None):
                break
            chain.append(block)
        for block in reversed(chain):  # deepest first, so the root ends most recent
            self.blocks.move_to_end(block.key)
        return chain

    def resume(
        self,
        ids: list[int],
        empty: ModelCache,
        need_experts: bool = False,
        images: PromptImages | None = None,
    ) -> Resume:
        """Fill `empty` (a fresh batch-1 cache) from the longest cached prefix of ids that leaves one id."""
        chain = self.match(ids, len(ids) - 1, need_experts, images)
        if not chain:
            self.stats.misses += 1
            return Resume(empty, 0, self.root)
        end = chain[-1].end
        self.stats.hits += 1
        self.stats.cached_tokens += end
        cache = state_store.join(empty, [b.tensors for b in chain], end)
        experts = torch.cat([b.experts for b in chain]).long() if need_experts else None  # type: ignore[misc]
        return Resume(cache, end, chain[-1].key, experts)

    # ---- inserting ---------------------------------------------------------------------------------------
    def add(
        self,
        parent: bytes,
        ids: list[int],
        cache: ModelCache,
        end: int,
        experts: torch.Tensor | None,
        media: bytes = b"",
    ) -> bytes:
        """Store the block ending at `end` of the sequence in `cache` (batch 1) whose last block is `parent`;
        ids: its `interval` ids; experts [interval, n_moe, k] or None; media: what its pads hold
        (`PromptImages.media`). Returns its key (the next parent)."""
        key = block_key(parent, ids, media)
        known = self.blocks.get(key)
        if known is not None:
            extra = experts.to(torch.int16) if experts is not None and known.experts is None else None
            if extra is not None and self._make_room(extra.nbytes, keep=set(self._chain(key))):
                known.tensors["experts"] = extra  # a recording sequence completes the block
                self.bytes += extra.nbytes
                if self.state_dir is not None:
                    self._write(known)
            return key
        if parent != self.root and parent not in self.blocks:
            return key  # its ancestors were evicted: unreachable, not worth storing
        tensors = state_store.cut(cache, 0, end - self.interval, end)
        tensors["tokens"] = torch.tensor(ids, dtype=torch.int32)
        if experts is not None:
            tensors["experts"] = experts.to(torch.int16)
        block = Block(key, parent, end, tensors, media)
        if self._admit(block) and self.state_dir is not None:
            self._write(block)
        return key

    def _admit(self, block: Block) -> bool:
        """Store a block whose parent is cached, evicting others (never its ancestors); False if it does
        not fit. Its chain is refreshed deepest first: the root ends most recent, so the least recently
        used block is always a leaf."""
        chain = self._chain(block.parent)
        if not self._make_room(block.nbytes, keep=set(chain)):
            return False
        self.blocks[block.key] = block
        self.children.setdefault(block.parent, set()).add(block.key)
        self.bytes += block.nbytes
        self.stats.inserted += 1
        for k in chain:
            self.blocks.move_to_end(k)
        return True

    def _chain(self, key: bytes) -> list[bytes]:
        """The keys of a cached block and its ancestors, deepest first."""
        out = []
        while key != self.root:
            out.append(key)
            key = self.blocks[key].parent
        return out

    def _make_room(self, nbytes: int, keep: set[bytes] = frozenset()) -> bool:  # type: ignore[assignment]
        """Evict least recently used blocks (never those in `keep`) until nbytes fit; False if they cannot."""
        if nbytes > self.max_bytes:
            return False
        while self.bytes + nbytes > self.max_bytes:
            victim = next((k for k in self.blocks if k not in keep), None)
            if victim is None:
                return False
            self._drop(victim, evicted=True)
        return True

    def _drop(self, key: bytes, evicted: bool = False) -> None:
        """Remove a block and every cached descendant (and their files)."""
        block = self.blocks.pop(key)
        self.bytes -= block.nbytes
        self.children.get(block.parent, set()).discard(key)
        self.stats.evicted += evicted
        if self.state_dir is not None:
            self._path(key).unlink(missing_ok=True)
        for child in list(self.children.pop(key, ())):
            if child in self.blocks:
                self._drop(child, evicted)

    def rekey(self, identity: str) -> None:
        """New weights: forget every block (and its file); new blocks hang off the new identity's root."""
        for key in list(self.blocks):
            if key in self.blocks:
                self._drop(key)
        self.identity = identity
        self.root = self._root()

    def _root(self) -> bytes:
        return hashlib.sha256(
            f"k3-prefix|{state_store.FORMAT}|{self.identity}|{self.interval}".encode()
        ).digest()

    # ---- disk --------------------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        assert self.state_dir is not None
        return self.state_dir / f"{key.hex()}.safetensors"

    def _write(self, block: Block) -> None:
        meta = {
            "key": block.key.hex(),
            "parent": block.parent.hex(),
            "end": str(block.end),
            "interval": str(self.interval),
            "media": block.media.decode(),
        }
        try:
            state_store.write(self._path(block.key), block.tensors, self.identity, meta)
        except OSError as e:  # a full or read-only disk costs the restart, never a request
            log.warning("prefix cache: could not write %s: %s", self._path(block.key), e)

    def load_dir(self) -> None:
        """Read back the blocks of `state_dir` (oldest file first, so LRU order survives), refusing what is
        not this checkpoint's, this format's, intact, or reachable."""
        assert self.state_dir is not None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        found: list[Block] = []
        for path in sorted(self.state_dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime):
            try:
                tensors, meta = state_store.read(path, self.identity)
                block = Block(
                    bytes.fromhex(meta["key"]),
                    bytes.fromhex(meta["parent"]),
                    int(meta["end"]),
                    tensors,
                    meta.get("media", "").encode(),
                )
                if meta.get("interval") != str(self.interval) or path.name != f"{meta['key']}.safetensors":
                    raise state_store.StateFileError(
                        f"{path.name}: interval {meta.get('interval')} or name differs"
                    )
                if block.key != block_key(block.parent, tensors["tokens"].tolist(), block.media):
                    raise state_store.StateFileError(f"{path.name}: its ids do not hash to its key")
            except (state_store.StateFileError, KeyError, ValueError) as e:
                self._refuse(path, str(e))
                continue
            found.append(block)
        for block in sorted(found, key=lambda b: b.end):  # parents before children
            if block.parent != self.root and block.parent not in self.blocks:
                self._refuse(self._path(block.key), "its parent block is missing")
            elif not self._admit(block):
                self._path(block.key).unlink(missing_ok=True)  # over the budget: as if evicted
        for block in found:  # oldest file first: the last used chains end most recent
            if block.key in self.blocks:
                for k in self._chain(block.key):
                    self.blocks.move_to_end(k)
        self.stats.inserted = 0
        log.info(
            "prefix cache: %d blocks (%d bytes) read back from %s",
            len(self.blocks),
            self.bytes,
            self.state_dir,
        )

    def _refuse(self, path: Path, why: str) -> None:
        """Log and skip a file (left in place: another checkpoint's may be someone else's; one of ours is
        overwritten when its block is computed again)."""
        log.warning("prefix cache: refused %s (recomputed when needed): %s", path, why)
        self.stats.refused.append(why)
