"""The generation engine: chunked prefill, batched decode, continuous batching. Token ids only.

One `Engine` owns a model and a set of sequences. Each `step()`:

1. drops cancelled sequences (their cache is freed at once);
2. prefills one chunk of the oldest waiting sequence (alone, batch of 1, so a long prompt never stalls the
   running streams for more than one chunk); when its prompt is done, its first token is sampled from the
   last prompt logits and it joins the decode batch (`ModelCache.stack`);
3. runs one decode step for every running sequence together: input [B, 1] (each row's last token), each
   row at its own context length (the model's cache keeps per-row lengths, see `k3.model.cache`);
   finished rows leave the batch (`ModelCache.select`).

Sequences join and leave between steps (continuous batching); sampling is per sequence with its own
`torch.Generator`, so a seeded request gives the same tokens whatever shares its batch.

Prefill chunks are sized so the attention scores of MLA layers, [heads, chunk, context] fp32, stay within
`attention_budget` bytes; with the default 2048-token chunks and a 512 MiB budget a 100k-token prompt
on `mini` prefills in chunks of ~160 tokens at its end.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from k3.config import K3Config, Mixer
from k3.engine.sampling import SamplingParams, sample_token
from k3.errors import K3Error
from k3.model.cache import KDAState, MLAState, ModelCache


class EngineError(K3Error):
    """A request the engine cannot run (empty prompt, too long for the model...)."""


class Status(StrEnum):
    WAITING = "waiting"  # prompt (partly) not yet prefilled
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request: its prompt, sampling state, output so far and (while waiting) its own cache."""

    id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" (a stop id), "length" (max_tokens or context), "cancelled"
    prefilled: int = 0  # prompt tokens already in the cache
    cache: ModelCache | None = None  # own cache while waiting; None once in the batch (or finished)
    seen: set[int] = field(default_factory=set)  # ids for the repetition penalty (prompt + output)

    @property
    def num_tokens(self) -> int:
        """Tokens in context: prompt + generated."""
        return len(self.prompt) + len(self.output)


@dataclass(frozen=True)
class Event:
    """What one step did to one sequence: a new token and/or the end (`finish_reason`)."""

    seq: Sequence
    token: int | None
    finish_reason: str | None = None
    logits: torch.Tensor | None = None  # [V] the token was drawn from (only with `record_logits`)


def cache_bytes_formula(cfg: K3Config, context: int, dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Bytes of one sequence's cache after `context` tokens, from the config alone.

    KDA layer: 3 conv tails of (ks-1) x P values (model dtype) + the [H, K, V] fp32 state: constant.
    MLA layer: (kv_lora_rank + qk_rope_head_dim) values per token (576 for K3), model dtype.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    n_kda = sum(p.mixer is Mixer.KDA for p in cfg.layer_plan)
    n_mla = cfg.num_hidden_layers - n_kda
    kda = n_kda * (
        3 * (cfg.kda_short_conv_kernel_size - 1) * cfg.kda_proj_size * elt
        + cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
    )
    mla = n_mla * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elt
    return {"kda": kda, "mla": mla, "total": kda + mla}


def row_cache_bytes(cache: ModelCache, row: int) -> dict[str, int]:
    """Bytes one row of a (batched) cache holds for its sequence: KDA state + the MLA positions in use."""
    kda = mla = 0
    for state in cache.layers:
        if isinstance(state, KDAState):
            kda += state.nbytes() // cache.batch_size
        elif isinstance(state, MLAState) and state.latent is not None and state.k_rope is not None:
            per_token = state.latent.shape[-1] * state.latent.element_size()
            per_token += state.k_rope.shape[-1] * state.k_rope.element_size()
            mla += int(state.lengths[row]) * per_token
    return {"kda": kda, "mla": mla, "total": kda + mla}


class Engine:
    """Continuous-batching generation over a `K3ForCausalLM`. Not thread-safe: one thread calls `step`."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch: int = 16,
        prefill_chunk: int = 2048,
        attention_budget: int = 512 * 2**20,
        record_logits: bool = False,
    ) -> None:
        self.model = model.eval()
        self.cfg: K3Config = model.config
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.attention_budget = attention_budget
        self.record_logits = record_logits
        self.max_context = self.cfg.max_position_embeddings
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # row i of self.batch is running[i]
        self.batch: ModelCache | None = None
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        if not prompt:
            raise EngineError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(
                f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.cfg.vocab_size - 1})"
            )
        if len(prompt) >= self.max_context:
            raise EngineError(
                f"the prompt has {len(prompt)} tokens; the model's context is {self.max_context}"
            )
        seq = Sequence(
            id=request_id or f"seq-{next(self._ids)}",
            prompt=list(prompt),
            params=params,
            generator=params.make_generator(),
            seen=set(prompt) if params.repetition_penalty != 1.0 else set(),
        )
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence now and free its cache (e.g. its client went away)."""
        if seq.status is Status.FINISHED:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.cache = None
        elif seq in self.running:
            self._drop_rows([self.running.index(seq)])
        seq.status, seq.finish_reason = Status.FINISHED, "cancelled"

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cache_bytes(self, seq: Sequence) -> dict[str, int]:
        """The cache one sequence holds now (zero once finished)."""
        if seq.status is Status.RUNNING and self.batch is not None:
            return row_cache_bytes(self.batch, self.running.index(seq))
        if seq.cache is not None:
            return row_cache_bytes(seq.cache, 0)
        return {"kda": 0, "mla": 0, "total": 0}

    # ---- the scheduler -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Event]:
        events: list[Event] = []
        if self.waiting and len(self.running) < self.max_batch:
            events += self._prefill_chunk(self.waiting[0])
        if self.running:
            events += self._decode_step()
        return events

    def chunk_size(self, done: int, remaining: int) -> int:
        """Tokens in the next prefill chunk: bounded by `prefill_chunk` and the MLA scores' budget."""
        size = min(self.prefill_chunk, remaining)
        if self.cfg.mla_layers:
            # scores + probabilities: 2 x [heads, size, done + size] fp32
            per_query = 2 * 4 * self.cfg.num_attention_heads * (done + size)
            size = min(size, max(16, self.attention_budget // per_query))
        return size

    def _prefill_chunk(self, seq: Sequence) -> list[Event]:
        if seq.cache is None:
            seq.cache = self.model.new_cache(1)
        size = self.chunk_size(seq.prefilled, len(seq.prompt) - seq.prefilled)
        chunk = torch.tensor([seq.prompt[seq.prefilled : seq.prefilled + size]])  # [1, size]
        logits = self.model(chunk, seq.cache, logits_to_keep=1)  # [1, 1, V]
        seq.prefilled += size
        if seq.prefilled < len(seq.prompt):
            return []
        self.waiting.remove(seq)
        event = self._sample(seq, logits[0, -1])
        if seq.status is Status.FINISHED:
            seq.cache = None
            return [event]
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.batch = seq.cache if self.batch is None else ModelCache.stack([self.batch, seq.cache])
        seq.cache = None
        return [event]

    def _decode_step(self) -> list[Event]:
        ids = torch.tensor([[seq.output[-1]] for seq in self.running])  # [B, 1]
        logits = self.model(ids, self.batch)[:, -1]  # [B, V]
        events = [self._sample(seq, logits[row]) for row, seq in enumerate(self.running)]
        done = [row for row, seq in enumerate(self.running) if seq.status is Status.FINISHED]
        if done:
            self._drop_rows(done)
        return events

    def _drop_rows(self, rows: list[int]) -> None:
        keep = [r for r in range(len(self.running)) if r not in rows]
        self.running = [self.running[r] for r in keep]
        self.batch = self.batch.select(keep) if keep and self.batch is not None else None

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> Event:
        """Draw seq's next token from logits [V]; finish it on a stop id, max_tokens or a full context."""
        p = seq.params
        seen = torch.tensor(sorted(seq.seen)) if p.repetition_penalty != 1.0 else None
        token = sample_token(logits, p, seq.generator, seen)
        kept = logits if self.record_logits else None
        if token in p.stop_ids:
            seq.status, seq.finish_reason = Status.FINISHED, "stop"
            return Event(seq, None, "stop", kept)
        seq.output.append(token)
        if p.repetition_penalty != 1.0:
            seq.seen.add(token)
        if len(seq.output) >= p.max_tokens or seq.num_tokens >= self.max_context:
            seq.status, seq.finish_reason = Status.FINISHED, "length"
        return Event(seq, token, seq.finish_reason, kept)

    # ---- conveniences ------------------------------------------------------------------------------------
    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        """Generate for one prompt, yielding tokens as they come (drives `step` itself: single-user use)."""
        seq = self.submit(prompt, params)
        try:
            while seq.status is not Status.FINISHED:
                for event in self.step():
                    if event.seq is seq and event.token is not None:
                        yield event.token
        finally:
            self.cancel(seq)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); the generated ids of each."""
        per = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.submit(p, sp) for p, sp in zip(prompts, per, strict=True)]
        while any(s.status is not Status.FINISHED for s in seqs):
            self.step()
        return [s.output for s in seqs]
