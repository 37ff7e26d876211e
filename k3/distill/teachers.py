"""The teachers of `k3 distill`: which teacher covers which domain (`--teacher NAME=CKPT[:task]`), loading
them frozen, the vocabulary they must share with the student, scoring the student's tokens, and the
averaged-weights baseline.

Scoring is one batched teacher-forced forward per teacher over the student's own tokens (k3.rl.policy's
packing), each sample scored by exactly its domain's teacher. Teachers are loaded once, in eval mode,
without gradients; a published checkpoint keeps its routed experts MXFP4-packed. Teachers and student must
share the tokenizer: `check_vocabularies` names what differs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from k3.distill.config import DistillError
from k3.rl.policy import Packed, pack
from k3.rl.rollout import Trajectory
from k3.tasks.effort import EFFORTS, is_task_name
from k3.tasks.task import TASK_NAMES


# ---- teachers ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TeacherSpec:
    name: str
    source: str  # a published checkpoint, a policy folder or a preset
    task: str | None  # the domain it teaches; None: every domain no other teacher claims (a generalist)


def parse_teacher(text: str) -> TeacherSpec:
    """`NAME=CKPT[:task]` -> TeacherSpec."""
    name, eq, rest = text.partition("=")
    if not eq or not name or not rest:
        raise DistillError(f"--teacher {text!r}: expected NAME=CKPT[:task]")
    source, colon, task = rest.rpartition(":")
    if not colon or not is_task_name(task):
        source, task = rest, None
    if not name.isidentifier():
        raise DistillError(
            f"--teacher {text!r}: the name {name!r} must be a plain identifier (it names log columns)"
        )
    return TeacherSpec(name, source, task)


def assign_domains(specs: list[TeacherSpec], tasks: list[str]) -> dict[str, str]:
    """{task: teacher name}: each task to the teacher that names it, the rest to the one generalist.
    `tasks`: extra domains to distil (a generalist's); the domains are these plus every teacher's task."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise DistillError(f"--teacher: names must differ, got {', '.join(names)}")
    owner: dict[str, str] = {}
    for s in specs:
        if s.task is not None:
            if s.task in owner:
                raise DistillError(f"--teacher: task {s.task} has two teachers ({owner[s.task]}, {s.name})")
            owner[s.task] = s.name
    generalists = [s.name for s in specs if s.task is None]
    if len(generalists) > 1:
        raise DistillError(f"--teacher: at most one teacher without a task, got {', '.join(generalists)}")
    for task in tasks:
        if not is_task_name(task):
            raise DistillError(
                f"--tasks: unknown task {task!r} (known: {', '.join(TASK_NAMES)}, each also at an effort "
                f"TASK@{'|'.join(EFFORTS)})"
            )
    for task in dict.fromkeys(tasks):
        if task not in owner:
            if not generalists:
                raise DistillError(f"--tasks: task {task} has no teacher (give one NAME=CKPT:{task})")
            owner[task] = generalists[0]
    if not owner:
        raise DistillError("no domain to distil: give NAME=CKPT:task teachers or --tasks for a generalist")
    return dict(sorted(owner.items()))


def load_teacher(source: str) -> nn.Module:
    """A frozen teacher: a published checkpoint keeps its MXFP4 experts packed (computed in fp32); a policy
    folder or preset loads as k3.rl.policy_io does."""
    from k3.model import K3ForCausalLM
    from k3.rl.policy_io import POLICY_FILE, load_policy

    path = Path(source)
    if path.is_dir() and not (path / POLICY_FILE).is_file():
        try:
            model = K3ForCausalLM.from_pretrained(path, compute_dtype=torch.float32)
        except Exception as e:
            raise DistillError(f"teacher {source}: {e}") from None
    else:
        model = load_policy(source, option="--teacher")
    return model.eval().requires_grad_(False)


# ---- vocabularies -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Vocabulary:
    """What a model's token ids mean: its vocabulary size, BPE ranks (digest) and special ids."""

    vocab_size: int
    n_ranks: int
    ranks_digest: str
    specials: tuple[tuple[str, int], ...]
    origin: str  # where the ranks came from (for the error message)


def _ranks_digest(ranks) -> str:
    h = hashlib.sha256()
    for token, rank in sorted(ranks, key=lambda item: item[1]):
        h.update(rank.to_bytes(4, "little") + len(token).to_bytes(4, "little") + token)
    return h.hexdigest()[:16]


def vocabulary_of(source: str, vocab_size: int) -> Vocabulary:
    """The tokenizer beside a checkpoint (tiktoken.model + tokenizer_config.json), or the built-in BPE of
    `vocab_size` ids (what k3 writes beside a checkpoint without one, and what policy folders imply)."""
    import json

    from k3.tokenizer.build import builtin_ranks
    from k3.tokenizer.kimi import CONFIG_FILE, TIKTOKEN_FILE, read_tiktoken_ranks, special_tokens_for

    path = Path(source)
    if (path / TIKTOKEN_FILE).is_file():
        ranks = list(read_tiktoken_ranks(path / TIKTOKEN_FILE).items())
        specials = special_tokens_for(len(ranks))
        config = path / CONFIG_FILE
        if config.is_file():
            decoder = json.loads(config.read_text()).get("added_tokens_decoder", {})
            specials = {v["content"]: int(k) for k, v in decoder.items()} or specials
        origin = str(path / TIKTOKEN_FILE)
    else:
        ranks = list(builtin_ranks(vocab_size))
        specials = special_tokens_for(len(ranks))
        origin = f"the built-in tokenizer of {vocab_size} ids"
    named = tuple(sorted((k, v) for k, v in specials.items() if not k.startswith("<|reserved_token_")))
    return Vocabulary(vocab_size, len(ranks), _ranks_digest(ranks), named, origin)


def vocabulary_difference(student: Vocabulary, teacher: Vocabulary) -> str | None:
    """What differs between two vocabularies, in words (None: they agree)."""
    if student.vocab_size != teacher.vocab_size:
        return f"vocab_size {teacher.vocab_size} (student: {student.vocab_size})"
    if student.n_ranks != teacher.n_ranks:
        return (
            f"{teacher.n_ranks} BPE ranks in {teacher.origin} "
            f"(student: {student.n_ranks} in {student.origin})"
        )
    if student.ranks_digest != teacher.ranks_digest:
        return f"the BPE ranks of {teacher.origin} differ from the student's ({student.origin})"
    mine, theirs = dict(student.specials), dict(teacher.specials)
    for token in sorted(set(mine) | set(theirs)):
        if mine.get(token) != theirs.get(token):
            return f"special token {token} has id {theirs.get(token)} (student: {mine.get(token)})"
    return None


def check_vocabularies(student: Vocabulary, teachers: dict[str, Vocabulary]) -> None:
    """Raise DistillError naming every teacher whose tokenizer differs from the student's, and how."""
    problems = [
        f"teacher {name}: {diff}"
        for name, vocab in teachers.items()
        if (diff := vocabulary_difference(student, vocab)) is not None
    ]
    if problems:
        raise DistillError(
            "teachers and student must share the tokenizer and vocabulary; " + "; ".join(problems)
        )


# ---- scoring ----------------------------------------------------------------------------------------------
def log_distributions(model: nn.Module, packed: Packed, temperature: float) -> torch.Tensor:
    """[N, T, V] log_softmax(logits / T) at the positions that predict each generated token."""
    logits = model(packed.inputs)  # [N, L, V]
    V = logits.shape[-1]
    picked = logits.gather(1, packed.positions[..., None].expand(-1, -1, V)).float()  # [N, T, V]
    return torch.log_softmax(picked / temperature, dim=-1)


def gather_tokens(log_dist: torch.Tensor, packed: Packed) -> torch.Tensor:
    """[N, T, V] -> [N, T] log-prob of each generated token; 0 past the end."""
    return log_dist.gather(-1, packed.targets[..., None])[..., 0] * packed.mask


@dataclass
class Scores:
    """Per generated token of a batch (rows in the trajectories' order, [N, T] right-padded)."""

    teacher: torch.Tensor  # log pi_teacher of the sampled token (its domain's teacher)
    student: torch.Tensor  # log pi_student (current weights) of the sampled token
    mask: torch.Tensor  # 1 on generated tokens
    teacher_dist: torch.Tensor | None = None  # [N, T, V] teacher log-distributions (full_vocab)
    tokens_scored: dict[str, int] | None = None  # generated tokens each teacher scored


@torch.no_grad()
def score(
    student: nn.Module,
    teachers: dict[str, nn.Module],
    teacher_of: list[str],
    trajectories: list[Trajectory],
    temperature: float,
    full_vocab: bool = False,
) -> Scores:
    """Each trajectory scored by its own teacher (`teacher_of[i]` names trajectory i's): one batched
    forward per teacher over its samples, and the student's forward over the same packed batch, so that a
    teacher equal to the student gives bitwise equal log-probs (advantage exactly 0)."""
    N, T = len(trajectories), max(len(t.tokens) for t in trajectories)
    out_t, out_s, mask = torch.zeros(N, T), torch.zeros(N, T), torch.zeros(N, T)
    dist = None
    counts = {}
    for name in dict.fromkeys(teacher_of):
        rows = [i for i, owner in enumerate(teacher_of) if owner == name]
        packed = pack([trajectories[i] for i in rows])
        n = packed.mask.shape[1]
        teacher_dist = log_distributions(teachers[name], packed, temperature)  # [n_rows, n, V]
        student_dist = log_distributions(student, packed, temperature)
        index = torch.tensor(rows)
        out_t[index, :n] = gather_tokens(teacher_dist, packed)
        out_s[index, :n] = gather_tokens(student_dist, packed)
        mask[index, :n] = packed.mask
        if full_vocab:
            if dist is None:
                dist = torch.zeros(N, T, teacher_dist.shape[-1])
            dist[index, :n] = teacher_dist
        counts[name] = int(packed.mask.sum())
    return Scores(out_t, out_s, mask, dist, counts)


# ---- the averaged-weights baseline ------------------------------------------------------------------------
def average_weights(models: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The mean of the models' state dicts (fp32), refused where names or shapes differ."""
    states = [m.state_dict() for m in models]
    first = states[0]
    for i, s in enumerate(states[1:], 1):
        if set(s) != set(first):
            missing = sorted(set(first) ^ set(s))[:3]
            raise DistillError(f"--method average: teacher {i} has other tensors ({', '.join(missing)}, ...)")
        for k, v in s.items():
            if v.shape != first[k].shape:
                raise DistillError(
                    f"--method average: {k} is {tuple(v.shape)} in teacher {i}, {tuple(first[k].shape)} in 0"
                )
    out = {}
    for k, v in first.items():
        if v.is_floating_point():
            out[k] = sum(s[k].double() for s in states).div(len(states)).to(v.dtype)
        else:
            out[k] = v.clone()
    return out
