"""Engines built on k3's `Engine`, each broken the way a public K3 bug broke one, for `k3 conform` to catch.

* `WrongBoundaryCache`: a prefix cache that keeps the state after every message boundary (`<|end_of_msg|>`)
  of a prompt and, for a later prompt starting with it, restores that state one token too early: the
  boundary token is fed twice (llama.cpp's K3 `--cache-reuse`, partial prompt-cache reuse corrupting chats).
* `SharedSlot`: prompts prefilled together in one batch end up decoding on the first one's KDA state
  (one user's KDA state leaking into another's, tt-metal).
* `PixelBlindCache`: k3's prefix cache keyed by the prompt's ids alone, so that an image's pads find the
  state of another image of the same size (a prefix cache that hashes tokens but not images).
* `drop_attn_res_read(model, layer)`: one layer's AttnRes read before its mixer skipped in decode steps
  (the mixer reads the open block alone: an AttnRes buffer overwritten, a vLLM fork).

(A module of tests/conform, importable by name.)
"""

from __future__ import annotations

import time

import torch

from k3.engine.generate import Engine
from k3.model.cache import KDAState


class WrongBoundaryCache(Engine):
    def __init__(self, model, end_of_msg: int, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.end_of_msg = end_of_msg
        self.stored: dict[tuple[int, ...], object] = {}  # prompt prefix -> the cache after it (a copy)

    def _prefill_chunk(self, seq):
        if seq.cache is None and seq.prefilled == 0:
            prompt = seq.prompt
            hits = [k for k in self.stored if len(k) < len(prompt) - 1 and tuple(prompt[: len(k)]) == k]
            if hits:
                key = max(hits, key=len)
                seq.cache = self.stored[key].select([0])
                seq.prefilled = len(key) - 1  # BUG: the state is after len(key) tokens
            else:
                ends = [i + 1 for i, t in enumerate(prompt[:-1]) if t == self.end_of_msg]
                if ends:  # prefill up to the last boundary, keep that state, go on from there
                    seq.cache = self.model.new_cache(1)
                    with torch.no_grad():
                        self.model(torch.tensor([prompt[: ends[-1]]]), seq.cache, logits_to_keep=1)
                    self.stored[tuple(prompt[: ends[-1]])] = seq.cache.select([0])
                    seq.prefilled = ends[-1]
        return super()._prefill_chunk(seq)


class PixelBlindCache(Engine):
    def submit(self, prompt, params, *args, **kwargs):
        seq = super().submit(prompt, params, *args, **kwargs)
        seq.prompt_images = None  # BUG: the blocks of its pads are keyed by their ids alone
        return seq


class SharedSlot(Engine):
    WINDOW = 0.2  # seconds a lone waiting prompt waits for company (batching windows, as servers have)

    def step(self):
        if len(self.waiting) == 1 and not self.running:
            since = self.__dict__.setdefault("_since", {}).setdefault(self.waiting[0].id, time.monotonic())
            if time.monotonic() - since < self.WINDOW:  # so that concurrent requests are batched for sure
                time.sleep(0.005)
                return []
        return super().step()

    def _prefill_together(self, seqs):
        before = len(self.running)
        events = super()._prefill_together(seqs)
        rows = list(range(before, len(self.running)))
        if len(rows) > 1 and self.batch is not None:
            for state in self.batch.layers:
                if isinstance(state, KDAState):  # BUG: every new row decodes on the first one's state
                    state.recurrent[rows[1:]] = state.recurrent[rows[0]].clone()
        return events


def drop_attn_res_read(model, layer: int) -> None:
    """Layer `layer`'s mixer reads the open block alone in decode steps instead of the AttnRes mixture."""
    model.set_fast_decode(True, one_call=False)  # the break is in Python: decode steps layer by layer
    target = model.model.layers[layer]
    original = target.mixer_read

    def broken(stream):
        unread = stream._values()[-1]  # the open block as it is before the read (and before any closing)
        x = original(stream)
        return unread if stream.stacked else x

    target.mixer_read = broken
