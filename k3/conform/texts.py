"""The fixed material of the scenarios and golden packs: multilingual prompts, chat conversations, long
documents. Everything is a function of the tokenizer only, so `k3 golden` and `k3 conform` build the same
token sequences and a golden pack can answer every request a scenario makes.

`chat_ids` is the one place the chat format is encoded: k3's server's own mapping of a chat request onto
K3's encoder (k3.engine.chat, the release's XTML format), so golden packs and conform follow it.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
from PIL import Image

from k3.engine.chat import chat_prompt
from k3.engine.images import ImageInput, load_image
from k3.tokenizer.kimi import Tokenizer
from k3.vision.prompt import image_prompt

# Real text in several languages and scripts (the Spanish from a published article on Kimi K3).
PROMPTS = {
    "es": "La tesis central de Kimi K3 es que el avance en la frontera de la IA requiere escalar dos "
    "recursos complementarios: la capacidad del modelo antes de su despliegue y el cómputo consumido "
    "después, durante inferencias largas con razonamiento, herramientas y ejecuciones agentivas.",
    "en": "The river had been rising for three days, and by the fourth morning the old bridge at the edge of "
    "the village was no more than a line of wet stones under brown water.",
    "fr": "Le musée ouvre ses portes à dix heures ; les visiteurs qui arrivent plus tôt peuvent attendre "
    "dans le jardin, où l'on sert du café et des croissants.",
    "de": "Die Messung wurde dreimal wiederholt, weil das erste Ergebnis deutlich von den Erwartungen abwich "
    "und niemand an einen Fehler im Versuchsaufbau glauben wollte.",
    "zh": "模型并不逐字阅读，而是读取词元，也就是词语的片段。"
    "每个词元都会完整地穿过模型，从第一层到最后一层。",
    "ja": "駅から歩いて十分ほどの所に小さな図書館があり、週末になると子どもたちが絵本を読みに集まってくる。",
    "ru": "Вечером поезд остановился на маленькой станции, и пассажиры вышли на платформу "
    "подышать свежим воздухом.",
    "code": "def fibonacci(n: int) -> list[int]:\n    out = [0, 1]\n    while len(out) < n:\n"
    "        out.append(out[-1] + out[-2])\n    return out[:n]\n",
}

SYSTEM = "You are a careful assistant. Answer briefly."

# a conversation that grows turn by turn (the assistant's replies fixed, so every turn is reproducible)
GROWING = [
    ("¿Qué es una ventana de contexto?", "Es la cantidad de tokens que el modelo puede leer a la vez."),
    ("And what happens beyond it?", "The engine refuses the request or drops the oldest tokens."),
    ("Donne un exemple concret.", "Un document de deux cents pages dépasse une petite fenêtre."),
    ("Summarise the three answers in one line.", None),
]

TOOL_TURNS = 10

IMAGE_SIZE = (112, 84)  # (w, h) of the `images` scenario's two images
IMAGE_REPLY = "A gradient of colours under fine noise."


def chat_ids(tokenizer: Tokenizer, messages: list[dict], images: list[ImageInput] | None = None) -> list[int]:
    """Token ids of a chat request with these messages (defaults otherwise: thinking on, effort max),
    ending by opening the assistant's turn, as k3's server encodes it; `images`: those of its image parts,
    in order (each part becomes the image's prompt: its size and one pad per row of the tower)."""
    prompts = None if images is None else [image_prompt(im.original, im.tokens) for im in images]
    return chat_prompt(messages, image_prompts=prompts).ids(tokenizer, add_generation_prompt=True)


def _scenario_pngs() -> dict[str, bytes]:
    """Two images of one size, so of one token count (the same prompt ids), with other pixels: smooth
    gradients under seeded noise, as PNG. An engine that finds a cached state by the prompt's ids alone
    answers the second with the first's state."""
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        rng = np.random.default_rng(seed)
        y, x = np.mgrid[0 : IMAGE_SIZE[1], 0 : IMAGE_SIZE[0]]
        base = np.stack([x * 255 / IMAGE_SIZE[0], y * 255 / IMAGE_SIZE[1], (x + y) % 64 * 4], axis=-1)
        if seed == 2:  # the same pattern turned half a turn
            base = base[::-1, ::-1]
        pixels = np.clip(base + rng.normal(0, 24, base.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "PNG")
        out[name] = buf.getvalue()
    return out


def image_chats() -> list[tuple[str, list[dict], list[ImageInput]]]:
    """(request name, messages, its images in order) of the `images` scenario: an image, another with the
    same ids, the first again, then a turn more on it, and both in one message. The messages carry the
    images as PNG data URLs; each image is prepared once, as k3's server prepares it."""
    pngs = _scenario_pngs()
    loaded = {name: load_image(png) for name, png in pngs.items()}

    def ask(names: list[str], text: str) -> dict:
        parts = [{"type": "image_url", "image_url": {"url": data_url(pngs[n])}} for n in names]
        return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}

    first = [{"role": "system", "content": SYSTEM}, ask(["a"], "Describe this image in one line.")]
    second = [{"role": "system", "content": SYSTEM}, ask(["b"], "Describe this image in one line.")]
    follow = [*first, {"role": "assistant", "content": IMAGE_REPLY}, {"role": "user", "content": "Why?"}]
    both = [{"role": "system", "content": SYSTEM}, ask(["b", "a"], "Which of the two is brighter?")]
    chats = [
        ("image a", first, ["a"]),
        ("image b (the same ids)", second, ["b"]),
        ("image a again", first, ["a"]),
        ("image a, one turn more", follow, ["a"]),
        ("images b and a", both, ["b", "a"]),
    ]
    return [(name, messages, [loaded[n] for n in names]) for name, messages, names in chats]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def growing_chat() -> list[list[dict]]:
    """The growing conversation's requests: turn k holds turns 1..k (replies of earlier turns included)."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    requests = []
    for question, answer in GROWING:
        messages.append({"role": "user", "content": question})
        requests.append([dict(m) for m in messages])
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    return requests


def tool_chat() -> list[list[dict]]:
    """A 10-turn conversation in which turn k extends turn k-1 with a tool call and its result."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM + " You may call the tool `weather`."}]
    cities = ["Madrid", "Lima", "Oslo", "Nairobi", "Kyoto", "Quito", "Perth", "Tunis", "Riga", "Hanoi"]
    requests = []
    for k, city in enumerate(cities[:TOOL_TURNS]):
        messages.append({"role": "user", "content": f"What is the weather in {city} today?"})
        requests.append([dict(m) for m in messages])
        arguments = json.dumps({"city": city})
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "weather", "arguments": arguments},
        }
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        result = json.dumps({"city": city, "celsius": 12 + 2 * k, "sky": "clear"})
        messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": result})
    return requests


def prompt_ids(tokenizer: Tokenizer) -> dict[str, list[int]]:
    return {name: tokenizer.encode(text) for name, text in PROMPTS.items()}


def equal_length_prompts(tokenizer: Tokenizer, n: int = 4, cap: int = 48) -> list[list[int]]:
    """n different prompts cut to one length (engines batch equal-length prompts into one forward)."""
    prompts = list(prompt_ids(tokenizer).values())[:n]
    length = min(cap, *(len(p) for p in prompts))
    return [p[:length] for p in prompts]


def long_document(tokenizer: Tokenizer, tokens: int) -> list[int]:
    """`tokens` ids of real text: the prompts one after another, repeated as needed."""
    unit = [t for ids in prompt_ids(tokenizer).values() for t in ids]
    return (unit * (tokens // len(unit) + 1))[:tokens]


def shifted_prompts(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """A prompt of real text (a 64-token head, a 200-token middle, a 300-token tail) and the same prompt with
    its middle dropped. An engine that reuses the cached tail at its new position (llama.cpp's
    `--cache-reuse N` shifts the KV rows of matching chunks of at least N tokens) keeps a recurrent state
    that still holds the middle: a hybrid's KDA state cannot be shifted."""
    doc = long_document(tokenizer, 564)
    return doc, doc[:64] + doc[264:]
