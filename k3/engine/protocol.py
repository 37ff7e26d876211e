"""The OpenAI-compatible API's request bodies and its errors.

Bodies are pydantic models in strict mode: a wrong JSON type (a string for `max_tokens`, a number for
`prompt`) is a validation error, which the server answers with 422 naming the field. Unknown fields are
accepted and ignored, as OpenAI clients send many, except those of OpenAI's and vLLM's that would change what
is sampled and k3 does not do (`logit_bias`, penalties, `best_of`...): set to anything but their neutral
value they are a 400, not output the client did not ask for. Errors are OpenAI-style JSON,
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from k3.engine.sampling import MAX_LOGPROBS

MAX_N = 16  # most choices per request
MAX_STOPS = 4  # most stop strings (OpenAI's limit)


class APIError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None) -> APIError:
    """400: a well-formed request the server cannot run (empty prompt, too long, ids out of range...)."""
    return APIError(400, message, "invalid_request_error", param)


# Fields of OpenAI's and vLLM's APIs that change what is sampled, which k3 does not implement, each with the
# values that change nothing.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "min_tokens": (None, 0),
    "min_p": (None, 0),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}


def refuse_not_implemented(body: BaseModel) -> None:
    """400 for the first field of NOT_IMPLEMENTED that the request sets to a value that would matter."""
    for name, value in (body.model_extra or {}).items():
        neutral = NOT_IMPLEMENTED.get(name)
        if neutral is not None and (isinstance(value, bool) or value not in neutral):  # True == 1 in Python
            allowed = "".join(f", or {v!r}" for v in neutral[1:])
            raise invalid(f"{name}: not implemented by this server (leave it out{allowed})", name)


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


class SamplingBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # keep generating past stop ids (as vLLM), e.g. for benchmarks


class CompletionBody(SamplingBody):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    echo: bool = False  # the prompt (text and, with logprobs, its tokens' log-probs) before the completion
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token


class ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers
    reasoning_content: str | None = None  # assistant: its think channel

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat encoder takes it (fields left unset are absent)."""
        return self.model_dump(exclude_unset=True)


class ChatFormatBody(BaseModel):
    """What shapes the chat prompt (shared by /v1/chat/completions and /tokenize)."""

    model_config = ConfigDict(extra="allow", strict=True)

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatBody(SamplingBody, ChatFormatBody):
    messages: list[ChatMessageBody] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class TokenizeBody(ChatFormatBody):
    """vLLM's /tokenize: a text `prompt` or chat `messages` (then `add_generation_prompt`, `tools` and the
    chat options as /v1/chat/completions takes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True  # K3 adds no special tokens to a text (no BOS): accepted, no effect
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


UNIONS = {  # what a field of several accepted forms must be
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": f"a string or a list of at most {MAX_STOPS} strings",
    "content": "a string or a list of content parts",
}
_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_error(errors: list[dict]) -> APIError:
    """422 naming the field of the first problem pydantic found (of several union branches, the one that
    got deepest into the value) or saying the JSON is malformed."""
    if not errors:
        return APIError(422, "body: invalid request", "invalid_request_error", "body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("loc", ("body", "?"))[-1]
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(
            422, f"body: malformed JSON at character {where}: {detail}", "invalid_request_error", "body"
        )

    def path(e: dict) -> list[str | int]:  # the location without "body" and union branch labels
        return [x for x in e.get("loc", ()) if x != "body" and not (isinstance(x, str) and _is_label(x))]

    field = path(first)[0] if path(first) else "body"
    same = [e for e in errors if (path(e) or ["body"])[0] == field]
    best = max(same, key=lambda e: (len(path(e)), not str(e.get("type", "")).endswith("_type")))
    where = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in path(best)).lstrip(".") or "body"
    message = f"{where}: {best.get('msg', 'invalid value')}"
    if field in UNIONS and len(same) > 1:
        message = f"{field}: must be {UNIONS[field]} ({message})"
    return APIError(422, message, "invalid_request_error", str(field))


def _is_label(x: str) -> bool:
    return "[" in x or x in _TYPE_LABELS
