"""The calculator task's rollouts are K3's chat format, as the release encodes it: the ids of a rollout with a
tool call equal the release's encoding (NeMo Automodel 0.7.0's K3 tokenizer, `apply_chat_template`) of the
same conversation, and the loss mask covers exactly the model's ids (the release's assistant mask, less the
channel openings the generation prompt writes). The model's turns are planted: the release's own ids of
each assistant message, served by a scripted engine that only answers the prompts the release predicts."""

from __future__ import annotations

import json

import pytest

from k3.engine.generate import Completion
from k3.rl.policy import pack
from k3.rl.rollout import Trajectory, generate
from k3.tasks.codec import CharCodec
from k3.tasks.registry import make_task
from k3.tasks.task import Problem
from k3.tasks.tool_task import EFFORT, TOOLS
from k3.tokenizer.build import write_tokenizer

VOCAB = 1024
PROBLEM = Problem("347*29=", "10063")


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory):
    """The release's tokenizer (chat template included), on the built-in tokenizer's files."""
    tokenization = pytest.importorskip("nemo_automodel.components.models.kimi_k3.tokenization")
    out = write_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)
    return tokenization.TikTokenTokenizer.from_pretrained(str(out))


def call(call_id: str, arguments: dict, name: str = "calculate") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def conversation(expression: str, result: str, answer: str) -> list[dict]:
    """user, an assistant call, the tool's result, the assistant's answer."""
    return [
        {"role": "user", "content": PROBLEM.prompt},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("functions.calculate:0", {"expression": expression})],
        },
        {"role": "tool", "tool_call_id": "functions.calculate:0", "content": result},
        {"role": "assistant", "content": answer},
    ]


class Scripted:
    """An engine whose 'model' writes, after each prompt the release predicts, the release's next turn."""

    def __init__(self, turns: dict[tuple[int, ...], list[int]], stop: int) -> None:
        self.turns, self.stop = turns, stop

    def complete(self, prompts, params, record_experts=False):
        out = []
        for prompt, p in zip(prompts, params, strict=True):
            turn = self.turns[tuple(prompt)]  # KeyError: the rollout fed a prompt the release does not write
            assert p.stop_ids == {self.stop} and p.max_tokens >= len(turn)
            n = len(turn)
            out.append(Completion(list(prompt), list(turn), [-0.5] * n, [0] * n, "stop", None))
        return out


def script(release, messages: list[dict], options: dict) -> tuple[list[int], dict, list[int], list[int]]:
    """(the prompt, the planted turns, the whole conversation's ids, the release's assistant mask)."""

    def ids(upto: int, generation: bool) -> list[int]:
        return release.apply_chat_template(
            messages[:upto], tools=TOOLS, tokenize=True, add_generation_prompt=generation, **options
        )

    turns = {}
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before, after = ids(i, True), ids(i + 1, False)
            assert after[: len(before)] == before
            turns[tuple(before)] = after[len(before) :]
    whole = release.apply_chat_template(
        messages, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **options
    )
    return ids(1, True), turns, whole["input_ids"], whole["assistant_masks"]


@pytest.mark.parametrize("thinking", [True, False])
def test_a_rollout_with_a_call_is_the_release_encoding(release, thinking: bool) -> None:
    codec = CharCodec(VOCAB)
    task = make_task("calculator", digits=3, thinking=thinking)
    options = {"thinking": thinking, "thinking_effort": EFFORT if thinking else None}
    prompt, turns, whole, assistant = script(release, conversation("347*29", "10063", "10063"), options)
    assert task.prompt_ids(PROBLEM, codec) == prompt
    stop = task.stop_id(codec)
    t = Trajectory(0, 0, task.prompt_ids(PROBLEM, codec))
    generate(Scripted(turns, stop), [t], seed=0, temperature=1.0, stop_id=stop, max_tokens=task.max_tokens,
             tool=task.tool(codec))  # fmt: skip
    assert t.finish_reason == "stop" and t.tool_calls == 1
    assert t.prompt + t.tokens == whole
    # the loss mask: the model's ids are the release's assistant ids, but for the channel opening
    # (<|open|>think<|sep|> or <|open|>response<|sep|>) the generation prompt writes before each turn
    opening = (
        len(release.encode("<|open|>", allowed_special="all"))
        + len(release.encode("think" if thinking else "response"))
        + 1
    )
    want = list(assistant)
    for j in range(1, len(want)):
        if assistant[j] and not assistant[j - 1]:
            want[j : j + opening] = [0] * opening
    mask = pack([t]).mask[0, : len(t.tokens)].tolist()
    assert mask == [float(m) for m in want[len(t.prompt) :]]
    assert sum(mask) == sum(len(turn) for turn in turns.values())
    assert task.reply(t.tokens, t.env, codec) == "10063"
    assert task.grade([PROBLEM], [task.reply(t.tokens, t.env, codec)]) == [1.0]


def test_a_wrong_call_gets_the_error_and_the_answer_is_graded(release) -> None:
    """A call the calculator cannot evaluate gets `error: ...` back (still the release's encoding of that
    result); the answer after it is graded on its content."""
    codec = CharCodec(VOCAB)
    task = make_task("calculator", digits=3)
    options = {"thinking": True, "thinking_effort": EFFORT}
    error = "error: cannot evaluate '347 times 29'"
    _, turns, whole, _ = script(release, conversation("347 times 29", error, "10064"), options)
    t = Trajectory(0, 0, task.prompt_ids(PROBLEM, codec))
    generate(Scripted(turns, task.stop_id(codec)), [t], seed=0, temperature=1.0, stop_id=task.stop_id(codec),
             max_tokens=task.max_tokens, tool=task.tool(codec))  # fmt: skip
    assert t.prompt + t.tokens == whole
    assert task.grade([PROBLEM], [task.reply(t.tokens, t.env, codec)]) == [0.0]


def test_a_direct_answer_ends_the_rollout(release) -> None:
    codec = CharCodec(VOCAB)
    task = make_task("calculator", digits=3)
    options = {"thinking": True, "thinking_effort": EFFORT}
    messages = [{"role": "user", "content": PROBLEM.prompt}, {"role": "assistant", "content": "10063",
                "reasoning_content": "347*29 is 10063"}]  # fmt: skip
    _, turns, whole, _ = script(release, messages, options)
    t = Trajectory(0, 0, task.prompt_ids(PROBLEM, codec))
    generate(Scripted(turns, task.stop_id(codec)), [t], seed=0, temperature=1.0, stop_id=task.stop_id(codec),
             max_tokens=task.max_tokens, tool=task.tool(codec))  # fmt: skip
    assert t.finish_reason == "stop" and t.tool_calls == 0 and not t.env
    assert t.prompt + t.tokens == whole and task.reply(t.tokens, t.env, codec) == "10063"


def test_the_sft_reference_is_the_release_answer(release) -> None:
    """`k3 rl sft` (and PTX) on the calculator: the prompt, then a direct answer as the release writes it;
    labels on exactly the answer's ids."""
    from k3.rl.sft import IGNORE, sft_batch

    codec = CharCodec(VOCAB)
    task = make_task("calculator", digits=3)
    messages = [{"role": "user", "content": PROBLEM.prompt}, {"role": "assistant", "content": "10063"}]
    prompt, turns, whole, _ = script(release, messages, {"thinking": True, "thinking_effort": EFFORT})
    assert task.reference_ids(PROBLEM, codec) == turns[tuple(prompt)]
    inputs, labels = sft_batch([PROBLEM], codec, task=task)
    assert inputs[0].tolist() == whole[:-1]
    assert [x for x in labels[0].tolist() if x != IGNORE] == turns[tuple(prompt)]


def test_the_calculator_itself() -> None:
    from k3.chat.parser import ToolCall
    from k3.tasks.tool_task import calculate, result

    assert calculate("347*29") == "10063" and calculate(" 12 + 30 ") == "42" and calculate("9-12") == "-3"
    assert calculate("2**8").startswith("error:")
    assert result(ToolCall(0, "x", "calculate", '{"expression": "6*7"}')) == "42"
    assert result(ToolCall(0, "x", "search", '{"expression": "6*7"}')) == "error: no tool 'search'"
    assert result(ToolCall(0, "x", "calculate", '{"expr": 1}')).startswith("error:")
    with pytest.raises(Exception, match="none of them code or calculator"):
        make_task("calculator+sort")


def test_the_budget_holds_a_call_and_an_answer(release) -> None:
    """max_tokens bounds the ids of the longest call, result and answer (9-digit operands)."""
    task = make_task("calculator", digits=9)
    a = "999999999"
    options = {"thinking": True, "thinking_effort": EFFORT}
    prompt, _, whole, _ = script(
        release, conversation(f"{a}*{a}", str(int(a) ** 2), str(int(a) ** 2)), options
    )
    assert len(prompt) + task.max_tokens >= len(whole)
