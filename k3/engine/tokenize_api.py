"""The tokenizer's endpoints, in vLLM's shapes: `/tokenize` (a text, or a chat exactly as
`/v1/chat/completions` prefills it), `/detokenize`, `/tokenizer_info` (the tokenizer's configuration).

    add_tokenize_routes(app, engine, tokenizer, check_model)   # from k3.engine.server.create_app
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI

from k3.engine.chat_inputs import encode_request, prompt_ids
from k3.engine.generate import Engine
from k3.engine.images import ImageInput
from k3.engine.outputs import token_text
from k3.engine.protocol import DetokenizeBody, TokenizeBody, invalid
from k3.tokenizer.kimi import Tokenizer, tokenizer_config


def _second(item: tuple[str, int]) -> int:
    return item[1]


def add_tokenize_routes(
    app: FastAPI,
    engine: Engine,
    tokenizer: Tokenizer,
    check_model: Callable[[str | None], None],
    images_of: Callable[[list], Awaitable[list[ImageInput] | None]],
) -> None:
    """Add the three endpoints to `app`; `check_model` answers 404 for another model's name; `images_of`:
    a chat's images as the server's chat completions take them (their prompts are part of the ids)."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict:
        """vLLM's /tokenize: the ids of a text, or of a chat exactly as /v1/chat/completions prefills it."""
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("tokenize: give exactly one of prompt (text) or messages (a chat)", "prompt")
        if body.continue_final_message:
            raise invalid(
                "continue_final_message: K3's chat encoder has no open-ended final message",
                "continue_final_message",
            )
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt)
        else:
            messages = body.messages or []
            chat = encode_request(body, messages, await images_of(messages))
            ids = prompt_ids(tokenizer, chat, body.add_generation_prompt)
        out: dict = {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [token_text(tokenizer, t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict:
        check_model(body.model)
        bad = [t for t in body.tokens if t >= tokenizer.vocab_size]
        if bad:
            raise invalid(
                f"tokens: ids {bad[:5]} are outside the vocabulary (0..{tokenizer.vocab_size - 1})", "tokens"
            )
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """vLLM's tokenizer info: the tokenizer's configuration (as tokenizer_config.json) and its class."""
        info = tokenizer_config(tokenizer.n_ranks, engine.max_context)
        template = next(iter(info["added_tokens_decoder"].values()))
        info["added_tokens_decoder"] = {
            str(i): {**template, "content": c}
            for c, i in sorted(tokenizer.special_tokens.items(), key=_second)
        }
        return info
