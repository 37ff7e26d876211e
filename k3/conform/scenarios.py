"""The scenarios `k3 conform` drives an engine through; each holds every returned logprob against k3's.

* prefix: a chat growing turn by turn, then its last turn one-shot. Catches a cached state restored at
  the wrong boundary (llama.cpp's K3 with `--cache-reuse`: correct only with `--cache-reuse 0`).
* tools: 10 turns, each extending the last with a tool call and its result (partial prompt-cache reuse).
* concurrent: N equal-length prompts at once, then each alone (one user's KDA state leaking into
  another's, tt-metal; batching).
* cancel: a streamed request dropped mid-generation, then new requests (a cancelled sequence's state).
* shifted: a prompt, then the same with its middle dropped (a cached chunk reused at a shifted position:
  llama.cpp's `--cache-reuse`, its K3 thread on PR #26185).
* long: a prompt near the engine's limit, and one past it, which must be a 4xx (NaN logits after a long
  prompt, vLLM #51039; a 5xx past the limit).
* repeat: one request three times (nondeterminism, state carried between requests).
* tokenize: the chat prompts through `/tokenize` where offered (a chat template other than k3's).
* images: a chat with an image, the same with another image of its size (the same prompt ids), the first
  again, a turn more, both in one message (a prefix cache keyed by ids alone answers the second with the
  first's state; image rows misplaced or cached under the wrong image); then their ids through `/tokenize`
  where it takes images (an image's prompt other than K3's). Skipped where k3's reference has no vision
  tower or the engine refuses images.

Generation is greedy (`temperature: 0`); the position of a generated token is its index in the request's
sequence (prompt + generated). k3's distribution there is computed on the tokens the engine saw and chose.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from k3.conform.client import EngineCallError, EngineClient, Generation
from k3.conform.reference import CheckpointReference, GoldenReference, ReferenceError
from k3.conform.report import ScenarioResult, hold
from k3.conform.texts import (
    chat_ids,
    equal_length_prompts,
    growing_chat,
    image_chats,
    long_document,
    prompt_ids,
    shifted_prompts,
    tool_chat,
)
from k3.engine.images import ImageInput


@dataclass
class Run:
    client: EngineClient
    reference: CheckpointReference | GoldenReference
    threshold: float
    max_tokens: int = 8
    concurrency: int = 4
    long_tokens: int | None = (
        None  # the near-limit prompt's length (default: the engine's limit - max_tokens)
    )

    def text(self, token: int) -> str:
        return self.client.tokenizer.decode([token])

    def check(
        self, result: ScenarioResult, name: str, prompt: list[int], gen: Generation, images: list = ()
    ) -> None:
        """Hold a greedy generation on `prompt` (holding `images`' pads) against k3."""
        ids = prompt + gen.tokens
        positions = [len(prompt) + j for j in range(len(gen.tokens))]
        expected = self.reference.expect(ids, positions, images)
        hold(result, name, gen.returned, expected, positions, self.threshold, self.text)
        if not gen.tokens:
            result.fail(f"{name}: the engine generated no token (finish_reason {gen.finish_reason!r})")

    def chat(
        self, result: ScenarioResult, name: str, messages: list[dict], images: list[ImageInput] | None = None
    ) -> Generation:
        gen = self.client.chat(messages, self.max_tokens)
        self.check(result, name, chat_ids(self.client.tokenizer, messages, images), gen, images or [])
        return gen

    def complete(self, result: ScenarioResult, name: str, prompt: list[int], max_tokens: int | None = None):
        gen = self.client.complete(prompt, max_tokens or self.max_tokens)
        self.check(result, name, prompt, gen)
        return gen


def prefix(run: Run, result: ScenarioResult) -> None:
    turns = growing_chat()
    for k, messages in enumerate(turns):
        run.chat(result, f"turn {k + 1}", messages)
    run.client.models()  # a pause between the growing turns and the one-shot
    run.chat(result, f"turn {len(turns)} one-shot again", turns[-1])


def tools(run: Run, result: ScenarioResult) -> None:
    for k, messages in enumerate(tool_chat()):
        run.chat(result, f"turn {k + 1}", messages)


def concurrent(run: Run, result: ScenarioResult) -> None:
    prompts = equal_length_prompts(run.client.tokenizer, run.concurrency)
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: run.client.complete(p, run.max_tokens), prompts))
    for i, (p, gen) in enumerate(zip(prompts, together, strict=True)):
        run.check(result, f"prompt {i} (concurrent)", p, gen)
    for i, p in enumerate(prompts):
        alone = run.complete(result, f"prompt {i} (alone)", p)
        if alone.tokens != together[i].tokens:
            result.notes.append(f"prompt {i}: the concurrent and the lone generation chose other tokens")


def cancel(run: Run, result: ScenarioResult) -> None:
    prompts = list(prompt_ids(run.client.tokenizer).values())
    run.client.start_and_cancel(prompts[0], max_tokens=64)
    run.complete(result, "new request after the cancel", prompts[1])
    run.complete(result, "the cancelled prompt again", prompts[0])


def shifted(run: Run, result: ScenarioResult) -> None:
    full, dropped = shifted_prompts(run.client.tokenizer)
    run.complete(result, "the whole prompt", full)
    run.complete(result, "its middle dropped", dropped)


def long(run: Run, result: ScenarioResult) -> None:
    limit = run.client.models().get("max_model_len")
    if run.long_tokens is None and not isinstance(limit, int):
        result.skipped = "the engine states no max_model_len in /v1/models: give --long-tokens"
        return
    near = run.long_tokens or limit - run.max_tokens
    document = long_document(run.client.tokenizer, near)
    run.complete(result, f"{near}-token prompt", document)
    if isinstance(limit, int):
        past = long_document(run.client.tokenizer, limit + 1)
        r = run.client.post("/completions", {"prompt": past, "max_tokens": 1, "temperature": 0})
        result.requests += 1
        if not 400 <= r.status_code < 500:
            result.fail(
                f"a {limit + 1}-token prompt (past the limit {limit}): HTTP {r.status_code}, not a 4xx"
            )


def repeat(run: Run, result: ScenarioResult, times: int = 3) -> None:
    prompt = prompt_ids(run.client.tokenizer)["en"]
    gens = [run.complete(result, f"repeat {i + 1}", prompt) for i in range(times)]
    for i, g in enumerate(gens[1:], 2):
        if g.tokens != gens[0].tokens:
            result.fail(f"repeat {i} chose other tokens than repeat 1: not deterministic")
        else:
            d = max(
                (abs(a.logprob - b.logprob) for a, b in zip(g.returned, gens[0].returned, strict=True)),
                default=0.0,
            )
            if d > 1e-6:
                result.notes.append(f"repeat {i}: logprobs differ from repeat 1 by up to {d:.3g}")


def tokenize(run: Run, result: ScenarioResult) -> None:
    for name, conversation in (("growing", growing_chat()), ("tools", tool_chat())):
        for k, messages in enumerate(conversation):
            ids = run.client.tokenize_chat(messages)
            if ids is None:
                result.skipped = "the engine offers no /tokenize"
                return
            if not same_ids(result, f"{name} turn {k + 1}", ids, chat_ids(run.client.tokenizer, messages)):
                return


def same_ids(result: ScenarioResult, name: str, ids: list[int], want: list[int]) -> bool:
    """Compare an engine's chat ids with k3's; a difference fails the scenario, naming where it starts."""
    result.requests += 1
    result.positions += len(want)
    if ids != want:
        j = next(
            (i for i, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b), min(len(ids), len(want))
        )
        result.fail(f"{name}: the engine's chat ids part from k3's at token {j}")
        return False
    result.top1_agree += len(want)
    return True


def images(run: Run, result: ScenarioResult) -> None:
    if not run.reference.sees_images:
        result.skipped = (
            "k3's reference has no vision tower (a checkpoint without vision_config, or a golden pack "
            "without image chats: of such a checkpoint, or written by a k3 before them)"
        )
        return
    chats = image_chats()
    for k, (name, messages, images) in enumerate(chats):
        try:
            run.chat(result, name, messages, images)
        except EngineCallError as e:
            if k == 0 and e.status is not None and 400 <= e.status < 500:  # no images served: not wrong
                result.skipped = f"the engine refuses images: {e}"
                return
            raise
    for name, messages, images in chats:  # the ids, where /tokenize takes images: the template
        try:
            ids = run.client.tokenize_chat(messages)
        except EngineCallError as e:
            result.notes.append(f"/tokenize of the image chats: {e}")
            return
        if ids is None:
            return
        if not same_ids(result, f"{name} (/tokenize)", ids, chat_ids(run.client.tokenizer, messages, images)):
            return


SCENARIOS: dict[str, Callable[[Run, ScenarioResult], None]] = {
    "prefix": prefix,
    "tools": tools,
    "concurrent": concurrent,
    "cancel": cancel,
    "shifted": shifted,
    "long": long,
    "repeat": repeat,
    "tokenize": tokenize,
    "images": images,
}


def run_scenarios(run: Run, names: list[str]) -> list[ScenarioResult]:
    results = []
    for name in names:
        result = ScenarioResult(name)
        try:
            SCENARIOS[name](run, result)
        except ReferenceError as e:
            result.skipped = f"not in the golden pack ({e}): use --checkpoint"
        except (EngineCallError, OSError) as e:
            result.fail(f"{type(e).__name__}: {e}")
        except (
            Exception
        ) as e:  # an HTTP library error, a malformed answer: the scenario fails, the run goes on
            result.fail(f"{type(e).__name__}: {e}")
        results.append(result)
    return results
