"""Per-layer inference state: what the model reads and writes when it continues a sequence.

One `ModelCache` holds one state per layer for a batch of B sequences:

* `KDAState` (KDA layers): the last `ks - 1` inputs of each short conv, `conv_q/conv_k/conv_v` [B, ks-1, P],
  and the recurrent state `recurrent` [B, H, K, V] in fp32. Constant size, whatever the context length.
* `MLAState` (MLA layers): per token the normalised latent [kv_lora] and the shared `k_rope` [rope] (the
  576 values the spec names), in buffers [B, capacity, .] that grow by doubling, plus `lengths` [B]: how
  many positions of each row are valid.

Batches of sequences of different lengths (right padding) are exact:
`model(input_ids [B, T], cache, lengths=n)` appends the first `n[b]` tokens of row b and ignores the rest:

* KDA: a padded position gets decay `g = 0` and `beta = 0`, so `S = (I - 0) diag(1) S + 0 = S`: the
  recurrent state after the chunk is the state after row b's last real token; the conv tails are the last
  real inputs of each row.
* MLA: the chunk's latents are written at positions `lengths[b] + t`; query t of row b sees keys
  `p <= lengths[b] + t` (a per-row causal mask), then `lengths[b] += n[b]`, so whatever a padded position
  wrote is overwritten by the row's next tokens and never seen before that.
* everything else (norms, AttnRes, MoE) works token by token.

So the engine may prefill each sequence alone (or a right-padded batch) and decode a batch in which every
sequence has its own length. Logits at padded positions are meaningless. Rows are independent: the engine
can build a batch with `ModelCache.stack` and split it with `ModelCache.select`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3.config import K3Config, Mixer


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class KDAState:
    """Conv tails [B, P, ks-1] (the last inputs before the conv) and the recurrent state [B, H, K, V] fp32."""

    conv_q: torch.Tensor | None = None
    conv_k: torch.Tensor | None = None
    conv_v: torch.Tensor | None = None
    recurrent: torch.Tensor | None = None

    def nbytes(self) -> int:
        return _nbytes(self.conv_q, self.conv_k, self.conv_v, self.recurrent)

    def select(self, rows: torch.Tensor) -> KDAState:
        return KDAState(*(None if t is None else t[rows] for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.conv_q, self.conv_k, self.conv_v, self.recurrent

    @staticmethod
    def stack(states: list[KDAState]) -> KDAState:
        parts = list(zip(*(s._tensors() for s in states), strict=True))
        if any(t is None for p in parts for t in p):
            raise ValueError("cannot stack KDA states of which some are still empty")
        return KDAState(*(torch.cat(p) for p in parts))


@dataclass
class MLAState:
    """Latents [B, capacity, kv_lora] and k_rope [B, capacity, rope]; `lengths` [B]: valid positions."""

    lengths: torch.Tensor
    latent: torch.Tensor | None = None
    k_rope: torch.Tensor | None = None

    def nbytes(self, *, used_only: bool = False) -> int:
        """Bytes held (`used_only`: only the valid positions, what the spec's 576 values per token count)."""
        if self.latent is None or self.k_rope is None:
            return 0
        if not used_only:
            return _nbytes(self.latent, self.k_rope)
        per_token = self.latent.shape[-1] * self.latent.element_size()
        per_token += self.k_rope.shape[-1] * self.k_rope.element_size()
        return int(self.lengths.sum()) * per_token

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Write a chunk (latent [B, T, L], k_rope [B, T, R]) after each row's valid positions.

        Row b's positions `lengths[b] + t` are written for every t < T, then `lengths[b] += counts[b]`.
        Returns the offsets before the chunk, [B], for the causal mask.
        """
        B, T, _ = latent.shape
        offsets = self.lengths.clone()
        need = int(offsets.max()) + T
        if self.latent is None or self.k_rope is None:
            self.latent = latent.new_zeros(B, max(need, 16), latent.shape[-1])
            self.k_rope = k_rope.new_zeros(B, max(need, 16), k_rope.shape[-1])
        else:
            self.reserve(T)
        rows = torch.arange(B, device=latent.device)[:, None]  # [B, 1]
        positions = offsets[:, None] + torch.arange(T, device=latent.device)  # [B, T]
        self.latent[rows, positions] = latent.to(self.latent.dtype)
        self.k_rope[rows, positions] = k_rope.to(self.k_rope.dtype)
        self.lengths = offsets + counts
        return offsets

    def reserve(self, tokens: int) -> None:
        """Room in the (allocated) buffers for `tokens` more positions of every row, growing by doubling."""
        assert self.latent is not None and self.k_rope is not None
        B, capacity, _ = self.latent.shape
        need = int(self.lengths.max()) + tokens
        if need > capacity:
            grow = max(need, 2 * capacity) - capacity
            self.latent = torch.cat([self.latent, self.latent.new_zeros(B, grow, self.latent.shape[-1])], 1)
            self.k_rope = torch.cat([self.k_rope, self.k_rope.new_zeros(B, grow, self.k_rope.shape[-1])], 1)

    def select(self, rows: torch.Tensor) -> MLAState:
        if self.latent is None or self.k_rope is None:
            return MLAState(self.lengths[rows])
        return MLAState(self.lengths[rows], self.latent[rows], self.k_rope[rows])

    @staticmethod
    def stack(states: list[MLAState]) -> MLAState:
        lengths = torch.cat([s.lengths for s in states])
        filled = [s for s in states if s.latent is not None and s.k_rope is not None]
        if not filled:
            return MLAState(lengths)
        cap = max(s.latent.shape[1] for s in filled)  # type: ignore[union-attr]
        ref = filled[0]

        def padded(s: MLAState, t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
            B = s.lengths.shape[0]
            out = like.new_zeros(B, cap, like.shape[-1])
            if t is not None:
                out[:, : t.shape[1]] = t
            return out

        latent = torch.cat([padded(s, s.latent, ref.latent) for s in states])  # type: ignore[arg-type]
        k_rope = torch.cat([padded(s, s.k_rope, ref.k_rope) for s in states])  # type: ignore[arg-type]
        return MLAState(lengths, latent, k_rope)


LayerState = KDAState | MLAState  # the state of one layer: its mixer's


@dataclass
class ModelCache:
    """One state per layer for a batch of `batch_size` sequences; `tokens` [B] counts tokens consumed."""

    layers: list[LayerState]
    tokens: torch.Tensor
    extra: dict = field(default_factory=dict)  # room for callers' bookkeeping; the model never reads it

    @classmethod
    def empty(cls, cfg: K3Config, batch_size: int, num_layers: int | None = None) -> ModelCache:
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        zeros = torch.zeros(batch_size, dtype=torch.long)
        states: list[LayerState] = [
            KDAState() if plan.mixer is Mixer.KDA else MLAState(zeros.clone()) for plan in cfg.layer_plan[:n]
        ]
        return cls(states, zeros.clone())

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)

    def select(self, rows: list[int] | torch.Tensor) -> ModelCache:
        """The cache of some rows (a copy), e.g. to drop finished sequences from a batch."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return ModelCache([s.select(idx) for s in self.layers], self.tokens[idx].clone())

    @staticmethod
    def stack(caches: list[ModelCache]) -> ModelCache:
        """Join caches of the same model row-wise (e.g. sequences prefilled one by one)."""
        layers: list[LayerState] = []
        for states in zip(*(c.layers for c in caches), strict=True):
            if isinstance(states[0], KDAState):
                layers.append(KDAState.stack(list(states)))  # type: ignore[arg-type]
            else:
                layers.append(MLAState.stack(list(states)))  # type: ignore[arg-type]
        return ModelCache(layers, torch.cat([c.tokens for c in caches]))
