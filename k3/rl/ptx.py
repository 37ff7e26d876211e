"""The PTX term (InstructGPT's "pretraining mix"): a next-token cross-entropy on other data, added to the RL
loss with weight `ptx_coef` at every optimizer step, so the policy keeps what it knew while RL moves it.

Data (`ptx_data`): `task` — the task's reference answers to fresh problems (`prompt answer [EOS]`, the
loss on answer and EOS, as `k3 rl sft` trains), or the path of an ASCII text file — windows of
`PTX_WINDOW` characters, the loss on every next character. Step s draws from the random stream
(seed, PTX_STREAM + s): a pure function of the optimizer step, so a resumed run draws the same batches,
and never the stream of an iteration's prompts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from k3.rl.config import RLConfig, RLError
from k3.rl.sft import IGNORE, sft_batch
from k3.tasks.codec import CharCodec
from k3.tasks.task import Task

PTX_STREAM = 10**6  # random streams PTX_STREAM + step: far from the iterations' 0, 1, 2, ...
PTX_WINDOW = 64  # characters per text window


def ptx_text(rc: RLConfig, codec: CharCodec) -> list[int] | None:
    """The ids of the `ptx_data` text file, read and checked once per run; None for the task's answers."""
    if rc.ptx_data == "task":
        return None
    path = Path(rc.ptx_data)
    try:
        ids = codec.encode(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RLError(f"--ptx-data {rc.ptx_data}: not 'task' nor a readable ASCII text file ({e})") from None
    if len(ids) < PTX_WINDOW + 1:
        raise RLError(
            f"--ptx-data {rc.ptx_data}: {len(ids)} characters, fewer than a window of {PTX_WINDOW + 1}"
        )
    return ids


def ptx_batch(
    rc: RLConfig, task: Task, codec: CharCodec, step: int, text: list[int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [B, L] of optimizer step `step`; labels IGNORE where no loss is taken. `text`:
    `ptx_text`'s ids, or None for the task's reference answers."""
    if text is None:
        return sft_batch(task.problems(rc.seed, PTX_STREAM + step, rc.ptx_batch), codec, task=task)
    rng = np.random.default_rng([rc.seed, PTX_STREAM + step])
    starts = rng.integers(0, len(text) - PTX_WINDOW, size=rc.ptx_batch)
    rows = torch.tensor([text[s : s + PTX_WINDOW + 1] for s in starts])  # [B, W + 1]
    return rows[:, :-1], rows[:, 1:]


def ptx_loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions."""
    logits = model(inputs)  # [B, L, V]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
