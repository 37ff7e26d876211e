"""The generation engine: chunked prefill, batched decode, continuous batching. Token ids only.

One `Engine` owns a model and a set of sequences. Each `step()`:

1. drops cancelled sequences (their cache is freed at once);
2. prefills one chunk of the oldest waiting sequence (alone, batch of 1, so a long prompt never stalls the
   running streams for more than one chunk); when its prompt is done, its first token is sampled from the
   last prompt logits and it joins the decode batch (`ModelCache.stack`). Waiting prompts of the oldest
   one's length that fit in one chunk are prefilled together instead, one [B, T] forward (many short
   prompts, e.g. RL rollouts, then cost one forward, not one each);
3. runs one decode step for every running sequence together: input [B, 1] (each row's last token), each
   row at its own context length (the model's cache keeps per-row lengths, see `k3.model.cache`);
   finished rows leave the batch (`ModelCache.select`).

Sequences join and leave between steps (continuous batching); sampling is per sequence with its own
`torch.Generator`, so a seeded request gives the same tokens whatever shares its batch.

Every generated token comes with its log-probability under the distribution it was drawn from (see
`k3.engine.sampling`), the `policy_version` of the weights that produced it and, if asked, its top
alternatives; a request may also ask for the log-probability of every prompt token (`prompt_logprobs`,
raw `log_softmax`) and for the experts every MoE router chose at every position fed (`record_experts`:
`k3.model.routing.record_routing` around each forward, its rows mapped back to the sequences of that
prefill chunk or decode batch). `complete` returns all of it as `Completion`s (the token-in/token-out API
of training loops); `load_weights` swaps the weights between requests.

Prefill chunks are sized so MLA layers attend within `attention_budget` bytes: in the plain form while the
chunk's whole context, expanded, fits (a 2,048-token prompt of K3's shapes in one chunk under the default
512 MiB), else in the absorbed form, whose scores [heads, chunk, context] fp32 must fit; with the default
2048-token chunks a 100k-token prompt on `mini` prefills in chunks of ~160 tokens at its end.

With a `PrefixCache` (k3.engine.prefix_cache) chunks also end at every multiple of its interval, where the
state is stored; a prompt resumes from the deepest stored state of its prefix (`Sequence.cached` tokens).
`state_of` / `save_state` / `load_state` and `submit(state=...)` keep one sequence's state across requests
or a restart (llama.cpp's slot save/restore).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from k3.config import K3Config
from k3.engine import state_store
from k3.engine.images import ImageCache
from k3.engine.prefix_cache import PrefixCache, PromptImages
from k3.engine.sampling import SamplingParams, draw
from k3.engine.sequence import Completion, EngineError, Event, Sequence, Status, TopLogprobs
from k3.engine.sequence_cache import keep_final_state, row_cache_bytes, start_cache, store_boundary
from k3.engine.state_store import SequenceState
from k3.model.cache import ModelCache
from k3.model.routing import record_routing
from k3.model.tiling import state_entries
from k3.vision.prompt import expand_placeholders


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
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.model = model.eval()
        self.cfg: K3Config = model.config
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.attention_budget = attention_budget
        model.set_attention_budget(attention_budget)  # one budget for the chunks' scores and MLA's plain form
        self.record_logits = record_logits
        self.max_context = self.cfg.max_position_embeddings
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # row i of self.batch is running[i]
        self.batch: ModelCache | None = None
        self._ids = itertools.count()
        self.policy_version = 0
        self.steps = 0  # calls of `step` that ran a forward
        self.prefix_cache = prefix_cache
        self.image_cache = ImageCache()  # the tower's rows by image content hash

    # ---- requests ----------------------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        record_experts: bool = False,
        state: SequenceState | None = None,
        keep_state: bool = False,
        images: list | None = None,
    ) -> Sequence:
        """Queue a prompt. `state`: continue that sequence state (the prompt must extend its tokens by at
        least one); `keep_state`: keep the state at the end (`state_of`). `images`: k3.engine.images.
        ImageInput per image of the prompt, in order (its pads expanded); such a prompt bypasses the prefix
        cache (its ids do not say which pixels its pads stand for)."""
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
            record_experts=record_experts,
            keep_state=keep_state,
        )
        if state is not None:
            n = len(state.tokens)
            if len(prompt) <= n or prompt[:n] != state.tokens:
                raise EngineError(f"the prompt must extend the state's {n} tokens by at least one")
            if record_experts or params.prompt_logprobs is not None:
                raise EngineError(
                    "a sequence continued from a state has no experts or log-probs of its start"
                )
            seq.state = state
        if images:
            seq.image_rows = self._image_rows(seq.prompt, images)
            if self.prefix_cache is not None:  # its blocks are keyed by the pixels their pads hold
                keyed = [(im.pixels_key, im.tokens) for im in images]
                seq.prompt_images = PromptImages(seq.prompt, self.model.media_pad_id, keyed)
        self.waiting.append(seq)
        return seq

    def _image_rows(self, prompt: list[int], images: list) -> torch.Tensor:
        """The images' rows [pads, hidden] (encoded once per content hash), checked against the pads."""
        rows = self.image_cache.rows(self.model, images)
        if expand_placeholders(prompt, self.model.media_pad_id, [r.shape[0] for r in rows]) != prompt:
            raise EngineError("the prompt must hold each image's placeholders expanded (one pad per row)")
        return torch.cat(rows)

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence now and free its cache (e.g. its client went away)."""
        if seq.status is Status.FINISHED:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.cache = None
        elif seq in self.running:
            seq.keep_state = False
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
        prefill, decode = bool(self.waiting) and len(self.running) < self.max_batch, bool(self.running)
        if prefill:
            group = self._prefill_group()
            events += (
                self._prefill_together(group) if len(group) > 1 else self._prefill_chunk(self.waiting[0])
            )
        if decode:
            events += self._decode_step()
        self.steps += prefill or decode
        return events

    def chunk_size(self, done: int, remaining: int, all_logits: bool = False) -> int:
        """Tokens in the next prefill chunk: bounded by `prefill_chunk`, by MLA's budget and, when every
        position's logits are kept, by their [size, V] fp32 within the same budget. MLA attends in the plain
        form while the chunk's context, expanded, fits the budget (MLAttention.plain_bytes: 240 KiB a
        position at K3's shapes, 2,184 positions in 512 MiB), else in the absorbed form, whose scores for
        the chunk's queries must fit it; a prompt longer than the plain form holds fills it first. Tokens up
        to the next boundary (or the prompt's end) under one bound go in chunks of about equal size (a
        chunk reads every weight once, however few its tokens): under a budget of 150 queries' scores, 610
        tokens as 5 x 122, not 4 x 150 + 10."""
        span = remaining
        if self.prefix_cache is not None:  # end at the next boundary, where the state is stored
            span = min(span, self.prefix_cache.interval - done % self.prefix_cache.interval)
        size = min(self.prefill_chunk, span)
        if all_logits:  # logits + log_softmax: 2 x [size, V] fp32
            size = min(size, max(16, self.attention_budget // (2 * 4 * self.cfg.vocab_size)))
        if self.cfg.mla_layers:
            plain = self.plain_room(done, size)
            if plain < size:
                # the absorbed form's scores + probabilities: 2 x [heads, size, done + size] fp32
                absorbed = self.attention_budget // (2 * 4 * self.cfg.num_attention_heads * (done + size))
                if plain >= max(16, absorbed):
                    return plain  # all the plain form holds; the absorbed form's chunks take the rest
                size = min(size, max(16, absorbed))
        pieces = -(-span // size)
        return -(-span // pieces)

    def plain_room(self, done: int, size: int) -> int:
        """The most tokens, up to `size`, a chunk after `done` positions can hold while MLA's plain form of
        its context and mask stays within the budget (the bytes grow with the chunk: a binary search)."""
        low, high = 0, size
        while low < high:
            mid = (low + high + 1) // 2
            fits = self.model.plain_attention_bytes(done + mid, mid) <= self.attention_budget
            low, high = (mid, high) if fits else (low, mid - 1)
        return low

    def _forward(
        self, ids: torch.Tensor, cache: ModelCache, seqs: list[Sequence], keep: int, **images
    ) -> torch.Tensor:
        """logits of ids [B, T] (row b continues seqs[b]); appends each row's experts to seqs that record.
        `images`: `features=[rows]` for the image pads of a one-sequence chunk."""
        if not any(seq.record_experts for seq in seqs):
            return self.model(ids, cache, logits_to_keep=keep, **images)
        with record_routing(self.model, scores=False, weights=False) as trace:
            logits = self.model(ids, cache, logits_to_keep=keep, **images)
        B, T = ids.shape
        k = self.cfg.num_experts_per_token
        chosen = [trace.indices(layer) for layer in trace.layers]  # per layer [B * T, k], row-major
        if any(c.shape[0] != B * T for c in chosen):
            raise EngineError(f"a router saw {[c.shape[0] for c in chosen]} rows for a forward of {B} x {T}")
        experts = torch.stack(chosen, 1) if chosen else torch.empty(B * T, 0, k, dtype=torch.long)
        for seq, rows in zip(seqs, experts.view(B, T, len(chosen), k), strict=True):  # [T, n_moe, k]
            if seq.record_experts:
                seq.experts.append(rows)
        return logits

    def _prefill_chunk(self, seq: Sequence) -> list[Event]:
        if seq.cache is None:
            seq.cache = start_cache(seq, self.model, self.prefix_cache)
        scoring = seq.params.prompt_logprobs is not None
        start = seq.prefilled
        size = self.chunk_size(start, len(seq.prompt) - start, all_logits=scoring)
        seq.standard_chunks &= size == self.chunk_size(start, len(seq.prompt) - start)
        chunk = torch.tensor([seq.prompt[start : start + size]])  # [1, size]
        images = {}
        if seq.image_rows is not None:  # this chunk's pads take the next rows
            pad = self.model.media_pad_id
            done = sum(t == pad for t in seq.prompt[:start])
            images["features"] = [seq.image_rows[done : done + int((chunk == pad).sum())]]
        logits = self._forward(chunk, seq.cache, [seq], keep=0 if scoring else 1, **images)
        seq.prefilled += size
        store_boundary(seq, self.prefix_cache)
        if scoring:
            self._score_prompt(seq, logits[0], start)
        if seq.prefilled < len(seq.prompt):
            return []
        self.waiting.remove(seq)
        if seq.params.max_tokens == 0:  # scoring only
            keep_final_state(seq, seq.cache, 0)
            seq.status, seq.finish_reason, seq.cache = Status.FINISHED, "length", None
            return [Event(seq, None, "length")]
        event = self._sample(seq, logits[0, -1])
        if seq.status is Status.FINISHED:
            keep_final_state(seq, seq.cache, 0)
            seq.cache = None
            return [event]
        seq.status = Status.RUNNING
        self.running.append(seq)
        self.batch = seq.cache if self.batch is None else ModelCache.stack([self.batch, seq.cache])
        seq.cache = None
        return [event]

    def _prefill_group(self) -> list[Sequence]:
        """The oldest waiting sequence and, while slots are free, every other waiting one that can be
        prefilled with it in one [B, T] forward: not started, same prompt length, a prompt that fits in
        one chunk, no prompt log-probs, at least one token to generate."""
        first = self.waiting[0]
        n = len(first.prompt)

        def fits(seq: Sequence) -> bool:
            return (
                seq.prefilled == 0
                and seq.cache is None
                and seq.state is None
                and seq.image_rows is None
                and len(seq.prompt) == n
                and seq.params.prompt_logprobs is None
                and seq.params.max_tokens > 0
            )

        if not fits(first) or self.chunk_size(0, n) < n:
            return [first]
        free = self.max_batch - len(self.running)
        return [seq for seq in self.waiting if fits(seq)][:free]

    def _prefill_together(self, seqs: list[Sequence]) -> list[Event]:
        """Prefill whole equal-length prompts in one forward (row b is seqs[b]); each row then samples its
        first token and joins the decode batch as `_prefill_chunk` does for one sequence."""
        cache = self.model.new_cache(len(seqs))
        ids = torch.tensor([seq.prompt for seq in seqs])  # [B, T]
        logits = self._forward(ids, cache, seqs, keep=1)[:, -1]  # [B, V]
        events, keep = [], []
        for row, seq in enumerate(seqs):
            self.waiting.remove(seq)
            seq.prefilled = len(seq.prompt)
            events.append(self._sample(seq, logits[row]))
            if seq.status is Status.FINISHED:
                keep_final_state(seq, cache, row)
            else:
                seq.status = Status.RUNNING
                keep.append(row)
        if keep:
            joined = cache if len(keep) == len(seqs) else cache.select(keep)
            self.running += [seqs[row] for row in keep]
            self.batch = joined if self.batch is None else ModelCache.stack([self.batch, joined])
        return events

    def _score_prompt(self, seq: Sequence, logits: torch.Tensor, start: int) -> None:
        """Log-probs of the prompt tokens that the chunk's logits [size, V] (positions start...) predict."""
        targets = torch.tensor(seq.prompt[start + 1 : start + 1 + logits.shape[0]])  # the last may be past
        logp = torch.log_softmax(logits[: targets.numel()].float(), dim=-1)  # [n, V]
        seq.prompt_logprobs += logp.gather(1, targets[:, None])[:, 0].tolist()
        seq.prompt_top += [_top(row, seq.params.prompt_logprobs) for row in logp]

    def _decode_step(self) -> list[Event]:
        ids = torch.tensor([[seq.output[-1]] for seq in self.running])  # [B, 1]
        logits = self._forward(ids, self.batch, self.running, keep=0)[:, -1]  # [B, V]
        events = [self._sample(seq, logits[row]) for row, seq in enumerate(self.running)]
        done = [row for row, seq in enumerate(self.running) if seq.status is Status.FINISHED]
        if done:
            self._drop_rows(done)
        return events

    def _drop_rows(self, rows: list[int]) -> None:
        for r in rows:
            keep_final_state(self.running[r], self.batch, r)  # type: ignore[arg-type]
        keep = [r for r in range(len(self.running)) if r not in rows]
        self.running = [self.running[r] for r in keep]
        self.batch = self.batch.select(keep) if keep and self.batch is not None else None

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> Event:
        """Draw seq's next token from logits [V]; finish it on a stop id, max_tokens or a full context."""
        p = seq.params
        seen = torch.tensor(sorted(seq.seen)) if p.repetition_penalty != 1.0 else None
        token, logp = draw(logits, p, seq.generator, seen)
        kept = logits if self.record_logits else None
        logprob, top = float(logp[token]), _top(logp, p.logprobs) if p.logprobs else None
        seq.logprobs.append(logprob)
        seq.versions.append(self.policy_version)
        if top is not None:
            seq.top.append(top)
        if token in p.stop_ids:
            seq.status, seq.finish_reason, seq.stop_token = Status.FINISHED, "stop", token
            return Event(seq, None, "stop", kept, logprob, top)
        seq.output.append(token)
        if p.repetition_penalty != 1.0:
            seq.seen.add(token)
        if len(seq.output) >= p.max_tokens or seq.num_tokens >= self.max_context:
            seq.status, seq.finish_reason = Status.FINISHED, "length"
        return Event(seq, token, seq.finish_reason, kept, logprob, top)

    # ---- one sequence's state (llama.cpp's slot save/restore) ---------------------------------------------
    def state_of(self, seq: Sequence) -> SequenceState:
        """The state of a running sequence (a copy), or of a finished one submitted with keep_state: it
        covers the prompt and the generated tokens fed so far (all but the last, unless it stopped)."""
        if seq.status is Status.RUNNING and self.batch is not None:
            row = self.running.index(seq)
            n = int(self.batch.tokens[row])
            return SequenceState((seq.prompt + seq.output)[:n], self.batch.select([row]))
        if seq.status is Status.FINISHED and seq.state is not None and seq.keep_state:
            return seq.state
        raise EngineError(f"sequence {seq.id} holds no state now (running, or finished with keep_state)")

    def identity(self) -> str:
        """Names the weights (and policy version) that states are valid for (k3.engine.state_store)."""
        return state_store.checkpoint_identity(self.model, self.policy_version)

    def save_state(self, state: SequenceState, path: str) -> None:
        """Write a sequence state to a safetensors file (atomic; identity and format in its metadata)."""
        state_store.save_sequence(Path(path), state, self.identity())

    def load_state(self, path: str) -> SequenceState:
        """Read a state written by `save_state` for these weights (StateFileError otherwise)."""
        return state_store.load_sequence(Path(path), self.identity(), self.model.new_cache(1))

    # ---- weights -----------------------------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy new weights into the model in place (names as in `model.state_dict()`, all of them, same
        shapes; floating tensors may come in another floating dtype) and set `policy_version`. Only between
        requests: raises EngineError while sequences are in flight, and changes nothing then."""
        if self.has_work:
            raise EngineError(
                f"load_weights: {len(self.waiting) + len(self.running)} sequences are in flight; "
                "swap weights between requests"
            )
        own = state_entries(self.model)  # {name: (shape, dtype)}: state_dict() would untile every matrix
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        misfit = [
            f"{name} {tuple(t.shape)}/{t.dtype} (model: {own[name][0]}/{own[name][1]})"
            for name, t in state_dict.items()
            if name in own
            and (
                tuple(t.shape) != own[name][0]
                or (
                    t.dtype != own[name][1] and not (t.is_floating_point() and own[name][1].is_floating_point)
                )
            )
        ]
        if missing or unexpected or misfit:
            raise EngineError(
                "load_weights: "
                + "; ".join(
                    f"{what}: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                    for what, names in (
                        ("missing", missing),
                        ("unexpected", unexpected),
                        ("mis-shaped", misfit),
                    )
                    if names
                )
            )
        # load_state_dict, not copies into state_dict()'s tensors: a tiled weight's entry there is a copy in
        # rows, and the Linears' pre-hook lays the rows out as the weight is (k3.model.tiling)
        self.model.load_state_dict(state_dict)
        self.policy_version = version
        self.image_cache = ImageCache(self.image_cache.size)  # rows of the old tower
        if self.prefix_cache is not None:  # states of the old weights are no use any more
            self.prefix_cache.rekey(self.identity())

    # ---- conveniences ------------------------------------------------------------------------------------
    def stream(self, prompt: list[int], params: SamplingParams, images: list | None = None) -> Iterator[int]:
        """Generate for one prompt, yielding tokens as they come (drives `step` itself: single-user use)."""
        seq = self.submit(prompt, params, images=images)
        try:
            while seq.status is not Status.FINISHED:
                for event in self.step():
                    if event.seq is seq and event.token is not None:
                        yield event.token
        finally:
            self.cancel(seq)

    def complete(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        *,
        record_experts: bool = False,
    ) -> list[Completion]:
        """Run prompts to completion together (continuous batching): ids, logprobs, policy versions and
        (with `record_experts`) routed experts of each. Drives `step` itself."""
        per = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.submit(p, sp, record_experts=record_experts) for p, sp in zip(prompts, per, strict=True)]
        try:
            while any(s.status is not Status.FINISHED for s in seqs):
                self.step()
        finally:
            for seq in seqs:
                self.cancel(seq)
        return [Completion.of(s) for s in seqs]

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); the generated ids of each (without
        the stop id)."""
        return [
            c.tokens[: len(c.tokens) - (c.finish_reason == "stop")] for c in self.complete(prompts, params)
        ]


def _top(logp: torch.Tensor, n: int) -> TopLogprobs:
    """The n most likely (id, log-prob) of logp [V], most likely first (-inf ones included if n asks)."""
    values, ids = torch.topk(logp, n)
    return list(zip(ids.tolist(), values.tolist(), strict=True))
