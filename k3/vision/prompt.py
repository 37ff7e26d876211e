"""Images in a prompt (spec section 6): `<|media_begin|>image {w}x{h}<|media_content|>` + N pads +
`<|media_end|>`, {w}x{h} the original size, N = gh*gw/4 merged tokens.

Two forms are accepted: the engines' expanded form (N `<|media_pad|>` per image) and the reference's
one-pad form (one `<|media_pad|>` per image, expanded here). Anything else is an error naming both counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3.errors import K3Error

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
)


class PromptError(K3Error):
    """Image placeholders that do not match the images given."""


def image_prompt(original: tuple[int, int], tokens: int, *, expanded: bool = True) -> str:
    """The text of one image in a prompt (specials spelled out; the tokenizer must allow them)."""
    w, h = original
    return f"{MEDIA_BEGIN}image {w}x{h}{MEDIA_CONTENT}{MEDIA_PAD * (tokens if expanded else 1)}{MEDIA_END}"


def pad_runs(ids: Sequence[int], pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `pad_id` in ids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == pad_id:
            j = i
            while j < len(ids) and ids[j] == pad_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def expand_placeholders(ids: Sequence[int], pad_id: int, tokens: Sequence[int]) -> list[int]:
    """Ids with each image's placeholders in the expanded form: image i has `tokens[i]` pads.

    Accepted: exactly sum(tokens) pads, each image's run as long as its token count (the expanded form,
    returned unchanged), or exactly one pad per image (the one-pad form, expanded in place).
    """
    ids = list(ids)
    total = sum(ids_i == pad_id for ids_i in ids)
    runs = pad_runs(ids, pad_id)
    if total == sum(tokens) and [n for _, n in runs] == list(tokens):
        return ids
    if total == len(tokens) and all(n == 1 for _, n in runs):
        out: list[int] = []
        start = 0
        for (pos, _), n in zip(runs, tokens, strict=True):
            out += ids[start:pos] + [pad_id] * n
            start = pos + 1
        return out + ids[start:]
    raise PromptError(
        f"the prompt has {total} <|media_pad|> placeholders in {len(runs)} runs "
        f"({[n for _, n in runs]}), but its {len(tokens)} images need {sum(tokens)} "
        f"({list(tokens)}, or one per image)"
    )
