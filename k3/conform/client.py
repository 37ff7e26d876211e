"""The OpenAI-compatible calls `k3 conform` makes, greedy and with logprobs, token ids mapped back.

Completions take the prompt as token ids (`prompt: [ids]`), so the engine sees exactly the sequence k3
scores; their legacy logprobs name tokens by text, mapped back through the checkpoint's vocabulary (k3
serve writes undecodable pieces as `bytes:\\xNN...`). Chat completions return each token's `bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from k3.conform.report import Returned
from k3.engine.outputs import token_text
from k3.errors import K3Error
from k3.tokenizer.kimi import Tokenizer

TOP = 5  # alternatives asked per position (the legacy completions API allows at most 5)


class EngineCallError(K3Error):
    """The engine answered a call with an error or with something the client cannot read."""


@dataclass
class Generation:
    tokens: list[int]  # generated ids
    returned: list[Returned]  # per generated token
    finish_reason: str | None


class EngineClient:
    def __init__(self, base_url: str, tokenizer: Tokenizer, api_key: str | None = None, timeout: float = 600):
        self.base = base_url.rstrip("/")
        self.root = self.base.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=timeout, headers=headers)
        self.tokenizer = tokenizer
        self.by_text = {token_text(tokenizer, t): t for t in range(tokenizer.vocab_size)}
        self.by_bytes = {tokenizer.token_bytes(t): t for t in range(tokenizer.vocab_size)}
        self._model: str | None = None

    # ---- plain calls --------------------------------------------------------------------------------------
    def models(self) -> dict:
        r = self.http.get(f"{self.base}/models")
        if r.status_code != 200:
            raise EngineCallError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:200]}")
        data = r.json().get("data") or [{}]
        self._model = data[0].get("id")
        return data[0]

    @property
    def model(self) -> str | None:
        if self._model is None:
            self.models()
        return self._model

    def post(self, path: str, body: dict, base: str | None = None) -> httpx.Response:
        return self.http.post(f"{base or self.base}{path}", json={"model": self.model, **body})

    def _ok(self, r: httpx.Response, what: str) -> dict:
        if r.status_code != 200:
            raise EngineCallError(f"{what}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    # ---- greedy generation with logprobs ----------------------------------------------------------------
    def complete(self, ids: list[int], max_tokens: int, top: int = TOP) -> Generation:
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": top}
        choice = self._ok(self.post("/completions", body), "POST /v1/completions")["choices"][0]
        lp = choice.get("logprobs") or {}
        if choice.get("text") and not lp.get("tokens"):
            raise EngineCallError(
                "POST /v1/completions returned text but no logprobs (conform asks logprobs: 5)"
            )
        returned = []
        for text, value, alts in zip(
            lp.get("tokens", []), lp.get("token_logprobs", []), lp.get("top_logprobs", []), strict=False
        ):
            if text not in self.by_text:
                raise EngineCallError(
                    f"the engine returned a token {text!r} not in the checkpoint's vocabulary"
                )
            alts = {self.by_text[t]: v for t, v in (alts or {}).items() if t in self.by_text}
            returned.append(Returned(self.by_text[text], value, alts))
        return Generation([r.token for r in returned], returned, choice.get("finish_reason"))

    def chat(self, messages: list[dict], max_tokens: int, top: int = TOP) -> Generation:
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": top,
        }
        choice = self._ok(self.post("/chat/completions", body), "POST /v1/chat/completions")["choices"][0]
        entries = (choice.get("logprobs") or {}).get("content") or []
        message = choice.get("message") or {}
        if (message.get("content") or message.get("reasoning_content")) and not entries:
            raise EngineCallError("POST /v1/chat/completions returned a message but no logprobs")
        returned = []
        for entry in entries:
            token = self.by_bytes.get(bytes(entry.get("bytes") or []))
            if token is None:
                raise EngineCallError(f"the engine returned a token {entry.get('token')!r} of unknown bytes")
            alts = {
                self.by_bytes[bytes(a["bytes"])]: a["logprob"]
                for a in entry.get("top_logprobs", [])
                if bytes(a.get("bytes") or []) in self.by_bytes
            }
            returned.append(Returned(token, entry["logprob"], alts))
        return Generation([r.token for r in returned], returned, choice.get("finish_reason"))

    def start_and_cancel(self, ids: list[int], max_tokens: int, events: int = 2) -> int:
        """A streamed completion closed after `events` chunks (the client goes away); returns chunks read."""
        body = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        seen = 0
        with self.http.stream("POST", f"{self.base}/completions", json=body) as r:
            if r.status_code != 200:
                raise EngineCallError(f"POST /v1/completions (stream): HTTP {r.status_code}")
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if seen >= events:
                        break
        return seen

    def tokenize_chat(self, messages: list[dict]) -> list[int] | None:
        """The engine's token ids of a chat prompt (`/tokenize` with messages), None where not offered."""
        r = self.post("/tokenize", {"messages": messages}, base=self.root)
        if r.status_code in (404, 405):
            return None
        data = self._ok(r, "POST /tokenize")
        return list(data.get("tokens") or data.get("ids") or [])

    def close(self) -> None:
        self.http.close()
