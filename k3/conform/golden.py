"""Golden packs: k3's exact numbers for a checkpoint, in a versioned folder another engine is held against.

    DIR/manifest.json        format k3-golden/1: the checkpoint's identity (every file's size and sha256),
                             k3's version, dtype, expert format, tolerances, the sequences, data hashes
    DIR/data.safetensors     per sequence i (prompt + greedy continuation):
                               seq.i.ids [T] int64
                               seq.i.top_ids [T, 20] int64, seq.i.top_logprobs [T, 20] f32
                                 (row p: the token after ids[:p + 1])
                               seq.i.next_logprob [T - 1] f32   the logprob of the token that follows
                               seq.i.hidden_rms [L, T] f32      RMS of the residual stream after each layer
                               seq.i.experts [T, n_moe, k] int64  routed expert ids (in memory only)
                             hidden.{layer} [T0, H] f32: full hidden states of sequence 0 after chosen layers
                             kda.{layer} [n, heads, K, V] f32: KDA states of the longest sequence at every
                               64-token boundary (kda_boundaries [n]; manifest kda_sequence; in memory only)
    DIR/logits.safetensors   the prompts' full logits in `k3 stream compare`'s format (when under 64 MB)
    DIR/prompts.jsonl        their token ids, for `k3 stream ... --prompts`

A checkpoint with a vision tower adds the `images` scenario's chats (their images' content hashes in the
manifest's sequences). Small checkpoints are computed in memory (`K3ForCausalLM`, or with the tower
`K3ForConditionalGeneration`); large ones through `k3 stream` (bounded memory:
no routed expert ids or KDA states then, and hidden RMS only for the dumped layers; the manifest says so).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import k3
from k3.conform.reference import GoldenSequence, pixel_inputs, reference_model
from k3.conform.report import THRESHOLDS
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
from k3.errors import K3Error
from k3.tokenizer.kimi import Tokenizer

FORMAT = "k3-golden/1"
TOP = 20
KDA_EVERY = 64
SUITES = ("default", "chat", "long")
SCRATCH = "scratch"  # the folder of a pack, while it is computed through `k3 stream`
LOGITS_CAP = 64 * 2**20  # bytes of full logits kept for `k3 stream compare` (else the file is left out)


class GoldenError(K3Error):
    """A golden pack that cannot be written, read or verified."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**22):
            h.update(block)
    return h.hexdigest()


def checkpoint_identity(ckpt: Path) -> dict:
    """Every file of the checkpoint folder: name, size, sha256."""
    files = [p for p in sorted(Path(ckpt).iterdir()) if p.is_file()]
    return {
        "source": str(Path(ckpt).resolve()),
        "files": [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)} for p in files],
    }


Prompt = tuple[str, list[int], list[ImageInput]]  # (name, prompt ids, the images its pads hold, in order)


def suite_sequences(tokenizer: Tokenizer, suite: str, long_tokens: int, vision: bool = False) -> list[Prompt]:
    """The prompts of a suite: the scenarios' prompts (and `concurrent`'s, cut to one length), their chats
    (with `vision`, a checkpoint with a vision tower: the `images` scenario's too), or long documents."""
    if suite not in SUITES:
        raise GoldenError(f"unknown suite {suite!r} (known: {', '.join(SUITES)})")
    text = [(f"prompt {name}", ids) for name, ids in prompt_ids(tokenizer).items()]
    text += [(f"concurrent {i}", ids) for i, ids in enumerate(equal_length_prompts(tokenizer))]
    if suite in ("default", "chat"):
        text += [(f"growing turn {k + 1}", chat_ids(tokenizer, m)) for k, m in enumerate(growing_chat())]
        text += [(f"tools turn {k + 1}", chat_ids(tokenizer, m)) for k, m in enumerate(tool_chat())]
    text += list(zip(("shifted whole", "shifted middle dropped"), shifted_prompts(tokenizer), strict=True))
    if suite == "long":
        text += [(f"document {n}", long_document(tokenizer, n)) for n in (long_tokens // 4, long_tokens)]
    out: list[Prompt] = [(name, ids, []) for name, ids in text]
    if vision and suite in ("default", "chat"):
        out += [
            (name, chat_ids(tokenizer, messages, images), images) for name, messages, images in image_chats()
        ]
    return out


def expert_format(cfg) -> str:
    return "mxfp4" if cfg.experts_mxfp4 else "plain"


# ---- computing ---------------------------------------------------------------------------------------------
@torch.no_grad()
def _greedy(model, prompt: list[int], n: int, images: list[ImageInput]) -> list[int]:
    cache = model.new_cache(1)
    logits = model(torch.tensor([prompt]), cache, logits_to_keep=1, **pixel_inputs(images))
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        if len(out) < n:
            logits = model(torch.tensor([[out[-1]]]), cache)
    return out


@torch.no_grad()
def _in_memory(model, ids: list[int], images: list[ImageInput]) -> dict[str, torch.Tensor]:
    """One sequence: logits, per-layer RMS and hidden states, routed experts."""
    from k3.model.routing import record_routing

    rms, hidden = [], []

    def hook(module, args, output):
        stream = args[0]
        total = sum(stream.blocks) + (stream.partial if stream.partial is not None else 0)  # [1, T, H]
        hidden.append(total[0].float())
        rms.append(total[0].float().pow(2).mean(-1).sqrt())

    handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
    try:
        with record_routing(model, scores=False, weights=False) as trace:
            logits = model(torch.tensor([ids]), **pixel_inputs(images))[0]
    finally:
        for h in handles:
            h.remove()
    experts = [trace.indices(layer) for layer in trace.layers]  # [T, k] each
    return {
        "logits": logits.float(),
        "hidden_rms": torch.stack(rms),
        "hidden": torch.stack(hidden),
        "experts": torch.stack(experts, 1) if experts else torch.empty(len(ids), 0, 0, dtype=torch.long),
    }


@torch.no_grad()
def _kda_states(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """The KDA recurrent states after every KDA_EVERY tokens of ids, chunk by chunk through a cache."""
    from k3.model.cache import KDAState

    cache = model.new_cache(1)
    states: dict[int, list[torch.Tensor]] = {}
    boundaries = []
    for start in range(0, len(ids) - KDA_EVERY + 1, KDA_EVERY):
        model(torch.tensor([ids[start : start + KDA_EVERY]]), cache, logits_to_keep=1)
        boundaries.append(start + KDA_EVERY)
        for i, state in enumerate(cache.layers):
            if isinstance(state, KDAState) and state.recurrent is not None:
                states.setdefault(i, []).append(state.recurrent[0].float().clone())
    out = {f"kda.{i}": torch.stack(s) for i, s in states.items()}
    out["kda_boundaries"] = torch.tensor(boundaries, dtype=torch.long)
    return out


def _rows(logits: torch.Tensor, ids: list[int]) -> dict[str, torch.Tensor]:
    lp = logits.double().log_softmax(-1)  # [T, V]
    top = lp.topk(min(TOP, lp.shape[-1]), -1)
    nxt = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0] if len(ids) > 1 else lp.new_zeros(0)
    return {"top_ids": top.indices, "top_logprobs": top.values.float(), "next_logprob": nxt.float()}


def compute(
    ckpt: Path,
    sequences: list[Prompt],
    continuation: int,
    via_stream: bool,
    hidden_layers: tuple[int, ...],
    scratch: Path | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict]]:
    """(data tensors, logits tensors of the prompt sequences, sequence descriptions). Through `k3 stream`,
    each pass keeps its state under `scratch` (None: in memory only), where a killed run resumes."""
    if via_stream:
        return _through_stream(ckpt, sequences, continuation, hidden_layers, scratch)
    model = reference_model(ckpt)
    data: dict[str, torch.Tensor] = {}
    described, prompt_logits = [], []
    for i, (name, prompt, images) in enumerate(sequences):
        ids = prompt + _greedy(model, prompt, continuation, images)
        out = _in_memory(model, ids, images)
        data |= {f"seq.{i}.{k}": v for k, v in _rows(out["logits"], ids).items()}
        data[f"seq.{i}.ids"] = torch.tensor(ids)
        data[f"seq.{i}.hidden_rms"] = out["hidden_rms"]
        data[f"seq.{i}.experts"] = out["experts"]
        if i == 0:
            data |= {f"hidden.{layer}": out["hidden"][layer] for layer in hidden_layers}
            data |= _kda_states(model, max((s for _, s, _ in sequences), key=len))  # the longest prompt
        if name.startswith("prompt "):
            prompt_logits.append(out["logits"][: len(prompt)])
        described.append(_described(name, prompt, ids, images))
    return data, _logits_file(prompt_logits, sequences), described


def _described(name: str, prompt: list[int], ids: list[int], images: list[ImageInput]) -> dict:
    """A sequence in the manifest: its name, lengths and the content hashes of its images."""
    return {
        "name": name,
        "prompt_tokens": len(prompt),
        "tokens": len(ids),
        "images": [im.key for im in images],
    }


def _logits_file(rows: list[torch.Tensor], sequences) -> dict[str, torch.Tensor]:
    """`k3 stream compare`'s format for the prompt sequences: logits [P, T, V], lengths, input_ids."""
    T, V = max(r.shape[0] for r in rows), rows[0].shape[-1]
    if len(rows) * T * V * 4 > LOGITS_CAP:
        return {}
    logits = torch.zeros(len(rows), T, V)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    for p, r in enumerate(rows):
        logits[p, : r.shape[0]] = r
        ids[p, : r.shape[0]] = torch.tensor(sequences[p][1])
    return {"logits": logits, "lengths": torch.tensor([r.shape[0] for r in rows]), "input_ids": ids}


def _through_stream(ckpt, sequences, continuation, hidden_layers, scratch: Path | None):
    """The same through `k3 stream` (bounded memory): a greedy pass, then every position of prompt +
    continuation with the chosen layers dumped; each run's state in its own folder under `scratch`."""
    from k3.stream.api import stream_logits
    from k3.stream.runner import StreamOptions

    def folder(name: str) -> Path | None:
        return None if scratch is None else scratch / name

    prompts = [p for _, p, _ in sequences]
    images = [[im.item for im in ims] for _, _, ims in sequences] if any(s[2] for s in sequences) else None
    options = StreamOptions(max_new_tokens=continuation)
    gen = stream_logits(ckpt, prompts, options, scratch_dir=folder("generate"), images=images)
    full = [p + gen.outputs["generated"][i].tolist() for i, p in enumerate(prompts)]
    options = StreamOptions(all_positions=True, top_k=TOP, dump_hidden=hidden_layers)
    out = stream_logits(ckpt, full, options, scratch_dir=folder("score"), images=images).outputs
    data: dict[str, torch.Tensor] = {}
    described, prompt_logits = [], []
    for i, ((name, prompt, ims), ids) in enumerate(zip(sequences, full, strict=True)):
        logits = out["logits"][i, : len(ids)]
        data |= {f"seq.{i}.{k}": v for k, v in _rows(logits, ids).items()}
        data[f"seq.{i}.ids"] = torch.tensor(ids)
        rms = [out[f"hidden.{layer}"][i, : len(ids)].pow(2).mean(-1).sqrt() for layer in hidden_layers]
        data[f"seq.{i}.hidden_rms"] = torch.stack(rms)
        if i == 0:
            data |= {f"hidden.{layer}": out[f"hidden.{layer}"][0, : len(ids)] for layer in hidden_layers}
        if name.startswith("prompt "):
            prompt_logits.append(logits[: len(prompt)])
        described.append(_described(name, prompt, ids, ims))
    return data, _logits_file(prompt_logits, sequences), described


# ---- writing, reading, verifying ---------------------------------------------------------------------------
def write_golden(
    ckpt: Path,
    out: Path,
    suite: str = "default",
    continuation: int = 8,
    via_stream: bool | None = None,
    long_tokens: int = 2048,
) -> dict:
    """Compute and write a golden pack; returns its manifest. `via_stream` None: in memory below 4 GB."""
    from k3.config import K3Config

    ckpt, out = Path(ckpt), Path(out)
    if not (ckpt / "config.json").is_file():
        raise GoldenError(f"{ckpt}: not a checkpoint folder (no config.json)")
    cfg = K3Config.from_pretrained(ckpt)
    tokenizer = Tokenizer.from_source(ckpt)
    identity = checkpoint_identity(ckpt)
    if via_stream is None:
        via_stream = sum(f["bytes"] for f in identity["files"]) > 4 * 10**9
    n = cfg.num_hidden_layers
    hidden_layers = tuple(sorted({0, n // 2, n - 1}))
    sequences = suite_sequences(tokenizer, suite, long_tokens, vision=cfg.vision_config is not None)
    scratch = out / SCRATCH  # the streamed passes' state: a killed `k3 golden write` resumes from it
    data, logits, described = compute(ckpt, sequences, continuation, via_stream, hidden_layers, scratch)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_save(data, out / "data.safetensors")
    files = ["data.safetensors"]
    for name in ("tiktoken.model", "tokenizer_config.json"):  # the pack reads its own token ids back
        if (ckpt / name).is_file():
            _atomic_text(out / name, (ckpt / name).read_text())
            files.append(name)
    if logits:
        _atomic_save(logits, out / "logits.safetensors")
        files.append("logits.safetensors")
        lines = [json.dumps({"input_ids": ids}) for name, ids, _ in sequences if name.startswith("prompt ")]
        _atomic_text(out / "prompts.jsonl", "\n".join(lines) + "\n")
        files.append("prompts.jsonl")
    manifest = {
        "format": FORMAT,
        "k3_version": k3.__version__,
        "suite": suite,
        "checkpoint": identity,
        "dtype": "float32",
        "expert_format": expert_format(cfg),
        "computed": "k3 stream" if via_stream else "in memory",
        "continuation": continuation,
        "top_k": TOP,
        "hidden_layers": list(hidden_layers),
        "kda_every": None if via_stream else KDA_EVERY,
        "kda_sequence": None
        if via_stream
        else max(range(len(sequences)), key=lambda i: len(sequences[i][1])),
        "tolerances": {"max_dlogprob": THRESHOLDS, "recompute_max_dlogprob": 1e-4},
        "sequences": described,
        "data": {name: sha256(out / name) for name in files},
    }
    _atomic_text(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)  # the pack is whole: its passes' state is no use any more
    return manifest


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": FORMAT})
    os.replace(tmp, path)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_manifest(pack: Path) -> dict:
    path = Path(pack) / "manifest.json"
    if not path.is_file():
        raise GoldenError(f"{pack}: not a golden pack (no manifest.json)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise GoldenError(f"{pack}: format {manifest.get('format')!r}, this k3 reads {FORMAT}")
    return manifest


def read_sequences(pack: Path) -> list[GoldenSequence]:
    """Every sequence of the pack: ids, top ids and logprobs, its images' hashes (for GoldenReference)."""
    manifest = read_manifest(pack)
    data = load_file(Path(pack) / "data.safetensors")
    return [
        GoldenSequence(
            data[f"seq.{i}.ids"].tolist(),
            data[f"seq.{i}.top_ids"],
            data[f"seq.{i}.top_logprobs"],
            described.get("images", []),
        )
        for i, described in enumerate(manifest["sequences"])
    ]


def verify_golden(pack: Path, ckpt: Path | None = None, sample: int = 2) -> list[str]:
    """Problems found (empty: the pack is sound): the data files' hashes; the checkpoint's files against
    the identity (when `ckpt` is given), and `sample` sequences recomputed and held to the tolerance (the
    first ones, text, and the first with images when the pack holds some: its images made again, their
    hashes checked)."""
    pack = Path(pack)
    manifest = read_manifest(pack)
    problems = [
        f"{name}: sha256 differs from the manifest (changed or damaged)"
        for name, digest in manifest["data"].items()
        if not (pack / name).is_file() or sha256(pack / name) != digest
    ]
    if problems or ckpt is None:
        return problems
    have = {f["name"]: f for f in checkpoint_identity(ckpt)["files"]}
    for f in manifest["checkpoint"]["files"]:
        if have.get(f["name"], {}).get("sha256") != f["sha256"]:
            problems.append(f"checkpoint file {f['name']}: not the one the pack was made from")
    if problems:
        return problems
    model = reference_model(ckpt)
    tolerance = manifest["tolerances"]["recompute_max_dlogprob"]
    sequences = read_sequences(pack)
    chosen = list(range(min(sample, len(sequences))))
    chosen += [i for i, s in enumerate(sequences) if s.images][:1]
    by_hash = {im.key: im for _, _, images in image_chats() for im in images}
    for i in chosen:
        s = sequences[i]
        if any(key not in by_hash for key in s.images):
            problems.append(f"sequence {i}: its images are not the ones this k3 makes (k3.conform.texts)")
            continue
        with torch.no_grad():
            lp = model(torch.tensor([s.ids]), **pixel_inputs([by_hash[k] for k in s.images]))[0]
            lp = lp.double().log_softmax(-1)
        d = float((lp.gather(1, s.top_ids) - s.top_logprobs.double()).abs().max())
        if d > tolerance:
            problems.append(f"sequence {i}: recomputed top-20 logprobs differ by {d:.3g} (> {tolerance:g})")
    return problems
