"""A chat request's model inputs, bad ones answered 400: its images (the `image_url` parts, checked and
preprocessed by k3.engine.images on the request's thread; the tower runs later on the engine thread) and
its prompt ids in K3's chat format (k3.engine.chat), each image's prompt in place of its part. Shared by
`/v1/chat/completions` and `/tokenize`, so that both give the same ids.

    images = chat_images(engine.model, body.messages)   # None without image parts; list[ImageInput]
    chat = encode_request(body, body.messages, images)   # k3.engine.chat.ChatPrompt
    ids = prompt_ids(tokenizer, chat)                    # what the engine prefills
"""

from __future__ import annotations

from typing import Any

from k3.engine.chat import ChatPrompt, ChatRequestError, request_prompt
from k3.engine.images import ImageInput, image_inputs
from k3.engine.protocol import ChatFormatBody, ChatMessageBody, invalid
from k3.engine.remote_images import RemoteImages
from k3.errors import K3Error
from k3.tokenizer.kimi import Tokenizer
from k3.vision.prompt import image_prompt


def has_images(messages: list[ChatMessageBody]) -> bool:
    return any(
        isinstance(m.content, list) and any(p.get("type") == "image_url" for p in m.content) for m in messages
    )


def chat_images(
    model: Any,
    messages: list[ChatMessageBody],
    *,
    remote: RemoteImages | None = None,
    max_images: int = 8,
    max_tokens: int | None = None,
) -> list[ImageInput] | None:
    """The images of a conversation's image_url parts, in order, validated and preprocessed (400 naming a
    bad one, or a model without a vision tower); None when it has no image parts."""
    if not has_images(messages):
        return None
    if not hasattr(model, "encode_images"):
        raise invalid(
            "messages: this model has no vision tower (its config has no vision_config)", "messages"
        )
    try:
        return image_inputs(messages, remote=remote, max_images=max_images, max_tokens=max_tokens)
    except K3Error as e:
        raise invalid(f"{e}", "messages") from e


def encode_request(
    body: ChatFormatBody, messages: list[ChatMessageBody], images: list[ImageInput] | None = None
) -> ChatPrompt:
    """The encoder's arguments; `images`: their prompts in place of the image parts, in order."""
    prompts = None if images is None else [image_prompt(im.original, im.tokens) for im in images]
    try:
        return request_prompt(body, messages, prompts)
    except ChatRequestError as e:
        raise invalid(str(e), e.param) from e


def prompt_ids(tokenizer: Tokenizer, chat: ChatPrompt, add_generation_prompt: bool = True) -> list[int]:
    try:
        return chat.ids(tokenizer, add_generation_prompt)
    except ChatRequestError as e:
        raise invalid(str(e), e.param) from e
