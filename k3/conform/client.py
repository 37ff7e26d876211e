"""The OpenAI-compatible calls `k3 conform` makes, greedy and with logprobs, token ids mapped back.

Completions take the prompt as token ids (`prompt: [ids]`), so the engine sees exactly the sequence k3
scores; their legacy logprobs name tokens by text, mapped back through the checkpoint's vocabulary (k3
serve writes undecodable pieces as `bytes:\\xNN...`). Chat completions return each token's `bytes`, and
llama.cpp's server answers completions in that format too, with each token's id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx

from k3.conform.report import Returned
from k3.engine.outputs import token_text
from k3.errors import K3Error
from k3.tokenizer.kimi import Tokenizer

TOP = 5  # alternatives asked per position (the legacy completions API allows at most 5)


class EngineCallError(K3Error):
    """The engine answered a call with an error (`status`: its HTTP status) or with something the client
    cannot read (`status` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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
            hint = " (an OpenAI-compatible base URL ends in /v1)" if not self.base.endswith("/v1") else ""
            raise EngineCallError(f"GET {self.base}/models: HTTP {r.status_code}{hint}: {r.text[:200]}")
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
            raise EngineCallError(f"{what}: HTTP {r.status_code}: {r.text[:300]}", r.status_code)
        return r.json()

    # ---- greedy generation with logprobs ----------------------------------------------------------------
    def complete(self, ids: list[int], max_tokens: int, top: int = TOP) -> Generation:
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "logprobs": top}
        choice = self._ok(self.post("/completions", body), "POST /v1/completions")["choices"][0]
        lp = choice.get("logprobs") or {}
        if "content" in lp:  # llama.cpp's server answers in the chat format, each token with its id and bytes
            returned = self._entries(lp["content"] or [])
        else:
            returned = self._legacy(lp)
        if choice.get("text") and not returned:
            raise EngineCallError(
                "POST /v1/completions returned text but no logprobs (conform asks logprobs: 5)"
            )
        return Generation([r.token for r in returned], returned, choice.get("finish_reason"))

    def _legacy(self, lp: dict) -> list[Returned]:
        """The legacy format: `tokens`, `token_logprobs`, `top_logprobs` ({text: logprob}), by token text."""
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
        return returned

    def _token(self, entry: dict) -> int | None:
        """An entry's token: its `id` where the engine gives one (llama.cpp does), else by its `bytes`."""
        if isinstance(entry.get("id"), int) and 0 <= entry["id"] < self.tokenizer.vocab_size:
            return entry["id"]
        return self.by_bytes.get(bytes(entry.get("bytes") or []))

    def _entries(self, entries: list[dict]) -> list[Returned]:
        """The chat format: one entry per token, `logprob`, `bytes`, `top_logprobs` [{bytes, logprob}].

        llama.cpp's server gives no entry to a token whose text is an incomplete UTF-8 sequence: its bytes
        lead the next entry's. Those tokens are recovered from the bytes, without a logprob (NaN: the report
        counts them as unscored), so that every later token keeps its position."""
        returned = []
        for entry in entries:
            token = self._token(entry)
            if token is None:
                raise EngineCallError(f"the engine returned a token {entry.get('token')!r} of unknown bytes")
            own = self.tokenizer.token_bytes(token)
            written = bytes(entry["bytes"]) if entry.get("bytes") else own
            if written != own and written.endswith(own):
                returned += [Returned(t, math.nan, {}) for t in self._split(written[: -len(own)], entry)]
            alts = {}
            for alt in entry.get("top_logprobs", []):
                alt_token = self._token(alt)
                if alt_token is not None:
                    alts[alt_token] = alt["logprob"]
            returned.append(Returned(token, entry["logprob"], alts))
        return returned

    def _split(self, data: bytes, entry: dict) -> list[int]:
        """The tokens whose bytes make up `data` (those an entry carried before its own), longest first."""
        out, start = [], 0
        while start < len(data):
            end = next((e for e in range(len(data), start, -1) if data[start:e] in self.by_bytes), None)
            if end is None:
                where = f"before token {entry.get('token')!r}"
                raise EngineCallError(f"the engine returned bytes {data!r} {where} that no token spells")
            out.append(self.by_bytes[data[start:end]])
            start = end
        return out

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
        returned = self._entries(entries)
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
        """The engine's token ids of a chat prompt, None where it offers no way to ask: `/tokenize` with
        messages (vLLM, k3 serve), else llama.cpp's two calls, `/apply-template` (its chat template's text)
        then `/tokenize` of that text with special tokens parsed, as its chat endpoint does."""
        r = self.post("/tokenize", {"messages": messages}, base=self.root)
        if r.status_code in (404, 405):
            return None
        data = self._ok(r, "POST /tokenize")
        tokens = list(data.get("tokens") or data.get("ids") or [])
        if tokens or not messages:
            return tokens
        r = self.post("/apply-template", {"messages": messages}, base=self.root)
        if r.status_code in (404, 405):
            return tokens
        prompt = self._ok(r, "POST /apply-template").get("prompt")
        if not isinstance(prompt, str):
            raise EngineCallError("POST /apply-template returned no prompt text")
        body = {"content": prompt, "add_special": False, "parse_special": True}
        data = self._ok(self.post("/tokenize", body, base=self.root), "POST /tokenize (the template's text)")
        return list(data.get("tokens") or [])

    def close(self) -> None:
        self.http.close()
