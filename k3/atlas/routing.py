"""Tokens and routing: which experts the router picks for each token of a text, layer by layer.

The model runs once per text (`K3ForCausalLM.from_pretrained`, loaded on first use) inside
`k3.model.routing.record_routing`, which reports every MoE layer's (weights, expert indices) per token.
When the checkpoint cannot be run here (no K3 config, no tokenizer, too large, a load error), `status()`
says why and the page shows it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from k3.checkpoint.reader import is_url

MAX_TEXT_CHARS = 2000
MAX_MODEL_BYTES = 8 * 10**9  # checkpoints larger than this are not loaded by the atlas


class RoutingUnavailable(RuntimeError):
    pass


class RoutingProbe:
    def __init__(self, source: str, config, checkpoint_bytes: int):
        self.source = source
        self.config = config
        self.checkpoint_bytes = checkpoint_bytes
        self._lock = threading.Lock()
        self._model = None
        self._tokenizer = None
        # why the model cannot run: (code the page translates, the details in English) or None
        self._error: tuple[str, str] | None = self._precheck()

    def _precheck(self) -> tuple[str, str] | None:
        if self.config is None:
            return "no_config", "no K3-family config.json: the model cannot be built"
        if is_url(str(self.source)) or not Path(self.source).is_dir():
            return "not_local", "the model runs from a local checkpoint directory only"
        if not (Path(self.source) / "tiktoken.model").exists():
            return "no_tokenizer", "the checkpoint has no tokenizer (tiktoken.model)"
        if self.checkpoint_bytes > MAX_MODEL_BYTES:
            return "too_large", (
                f"the checkpoint holds {self.checkpoint_bytes / 1e9:,.1f} GB; the atlas runs models up to "
                f"{MAX_MODEL_BYTES / 1e9:,.0f} GB"
            )
        if not self.config.num_experts:
            return "no_experts", "the model has no experts"
        return None

    def tokenizer(self):
        if self._tokenizer is None:
            from k3.tokenizer.kimi import Tokenizer

            self._tokenizer = Tokenizer.from_dir(self.source)
        return self._tokenizer

    def status(self) -> dict[str, Any]:
        code, reason = self._error or (None, None)
        return {"available": self._error is None, "code": code, "reason": reason}

    def _load(self):
        if self._model is None:
            from k3.model import K3ForCausalLM

            try:
                self._model = K3ForCausalLM.from_pretrained(self.source).eval()
            except Exception as e:  # any load failure becomes the reason shown on the page
                self._error = ("load_error", f"the model does not load: {e}")
                raise RoutingUnavailable(self._error[1]) from e
        return self._model

    def route(self, text: str) -> dict[str, Any]:
        """Tokens of `text` and, per MoE layer, the experts chosen for each token with their weights."""
        import torch

        from k3.model.routing import record_routing

        if self._error is not None:
            raise RoutingUnavailable(self._error[1])
        if not text or len(text) > MAX_TEXT_CHARS:
            raise ValueError(f"text must have 1..{MAX_TEXT_CHARS} characters")
        with self._lock:
            tok = self.tokenizer()
            pieces = tok.pieces(text)
            model = self._load()
            with torch.no_grad(), record_routing(model, scores=False) as trace:
                model(torch.tensor([[i for i, _ in pieces]]))
        layers = {}
        for i in trace.layers:
            weights, indices = trace.weights(i), trace.indices(i)  # [T, k] each
            order = weights.argsort(dim=-1, descending=True)
            layers[i] = {
                "experts": indices.gather(-1, order).tolist(),  # [T, k], heaviest first
                "weights": [[round(w, 5) for w in row] for row in weights.gather(-1, order).tolist()],
            }
        return {
            "tokens": [{"id": i, "piece": b.decode("utf-8", errors="replace")} for i, b in pieces],
            "top_k": self.config.num_experts_per_token,
            "num_experts": self.config.num_experts,
            "layers": layers,
        }
