"""The training loop: AdamW or Muon, warm-up + cosine/WSD, gradient accumulation, clipping, routing balance,
CSV log, atomic resumable checkpoints, and an MXFP4 export at the end.

A run lives in one folder:

    RUN/train.json            the TrainConfig (a rerun with the same folder must agree with it)
    RUN/log.csv               one row per optimizer step (see `log_columns`)
    RUN/loads.csv             tokens per expert, per step and MoE layer (step, layer, e0, e1, ...)
    RUN/checkpoints/step-N/   resumable state (k3.train.state), the newest two kept
    RUN/export/               the trained model in the published layout (routed experts MXFP4)

Rerunning a killed run continues from its newest checkpoint: the CSV is cut back to that step and the
remaining steps see the same batches, RNG and optimizer state, so on CPU the losses equal an
uninterrupted run's bit for bit.

Routing balance needs each MoE layer's router scores for the batch: the trainer records them, with the
chosen experts, through `record_routing` (k3.model.routing), as the routers computed them. After the
optimizer step the balancer turns them into new biases, written to the routers' `e_score_correction_bias`
buffers; so the bias a batch is routed with comes from earlier batches only.

With `balance_refresh` (QB only) the step's batch is routed once more after the optimizer step, as one
batch without gradients, and every router fits QB to it just before routing it: the bias then fits the
step's batch as the *updated* model routes it, each layer's input already routed by the refitted biases
below it. That removes the router's and the lower layers' drift from what the next batch sees, for one
extra forward pass per step.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.model.routing import record_routing
from k3.train.config import TrainConfig, TrainError
from k3.train.data import IGNORE, MQAR, Copying, Dataset, TextFile, answer_accuracy
from k3.train.optim import build_optimizer
from k3.train.routing import RoutingBalancer, chosen_loads, max_over_mean
from k3.train.schedule import learning_rate
from k3.train.state import list_checkpoints, load_training_state, save_training_state

TRAIN_JSON = "train.json"
LOG_FILE = "log.csv"
LOADS_FILE = "loads.csv"
EXPORT_DIR = "export"
# Fields that may change between a run and its resumption without changing what is computed.
_RESUMABLE_CHANGES = {"stop_after", "progress", "export"}


def load_model_config(preset: str) -> K3Config:
    try:
        return K3Config.from_pretrained(preset)
    except Exception as e:
        raise TrainError(f"--preset: {e}") from None


def make_dataset(tc: TrainConfig, cfg: K3Config, stream: int = 0) -> Dataset:
    """The task named by `--data`; `stream` 1 gives held-out batches of a synthetic task."""
    V = cfg.vocab_size
    if tc.data == "mqar":
        return MQAR(V, tc.seq_len, tc.batch_size, tc.num_kv_pairs, seed=tc.seed, stream=stream)
    if tc.data == "copy":
        return Copying(V, tc.seq_len, tc.batch_size, seed=tc.seed, stream=stream)
    path = Path(tc.data)
    if not path.is_file():
        raise TrainError(f"--data: expected mqar, copy or a text file; {tc.data!r} is none of these")
    if tc.tokenizer is not None:
        from k3.tokenizer.kimi import Tokenizer

        tokenizer = Tokenizer.from_dir(tc.tokenizer)
    else:
        from k3.tokenizer.build import builtin_tokenizer

        tokenizer = builtin_tokenizer(V)
    return TextFile(path, tokenizer, tc.seq_len, tc.batch_size, V, seed=tc.seed + 7919 * stream)


def log_columns(moe_layers: list[int], extra: list[str]) -> list[str]:
    per_layer = [f"load_max_over_mean_L{i}" for i in moe_layers]
    return ["step", "loss", "lr", "grad_norm", "tokens_per_s", "max_over_mean_load", *per_layer, *extra]


def _prepare_run(tc: TrainConfig, run: Path) -> None:
    """Write train.json, or check that an existing one describes the same computation."""
    path = run / TRAIN_JSON
    mine = {k: v for k, v in asdict(tc).items() if k not in _RESUMABLE_CHANGES}
    if path.is_file():
        theirs = {k: v for k, v in json.loads(path.read_text()).items() if k not in _RESUMABLE_CHANGES}
        changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if changed:
            raise TrainError(
                f"{run} holds a run with other settings ({', '.join(changed)}); choose another --out"
            )
    run.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(tc), indent=1) + "\n")
    tmp.replace(path)


def _cut_log(path: Path, columns: list[str], step: int) -> None:
    """Keep only complete rows up to `step` (rows written after the checkpoint, or a half-written line,
    are dropped), so the resumed run writes them again."""
    rows = []
    if path.is_file():
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                if None in row.values() or row.get("step") in (None, ""):
                    break  # a torn last line
                if int(row["step"]) <= step:
                    rows.append(row)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def evaluate(model: nn.Module, data: Dataset, batches: int, autocast: bool = False) -> tuple[float, float]:
    """(mean loss, answer accuracy) over `batches` held-out batches, counted positions only."""
    was_training = model.training
    model.eval()
    losses, correct, counted = [], 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for i in range(batches):
            inputs, labels = data.batch(i)
            logits = model(inputs).float()
            losses.append(float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)))
            n = int((labels != IGNORE).sum())
            correct += answer_accuracy(logits, labels) * n
            counted += n
    model.train(was_training)
    return sum(losses) / len(losses), correct / counted


def refit_on_updated_model(
    model: nn.Module, balancer: RoutingBalancer, data: Dataset, step: int, tc: TrainConfig
) -> None:
    """Route step `step`'s micro-batches again, as one batch, with the model as it is now (after the
    optimizer step); each router fits its bias to the batch just before routing it, so layer l sees its
    input as routed by the refitted biases of the layers below."""

    def fit_then_route(layer: int) -> Callable:
        def pre_hook(router: nn.Module, args: tuple) -> None:
            with torch.no_grad():
                balancer.fit(layer, router.scores(args[0]))
            router.e_score_correction_bias.copy_(balancer.biases[layer])

        return pre_hook

    inputs = torch.cat([data.batch(step * tc.accum + micro)[0] for micro in range(tc.accum)])  # [accum B, L]
    routers = model.routers().items()
    hooks = [router.register_forward_pre_hook(fit_then_route(layer)) for layer, router in routers]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.dtype == "bf16"):
            model(inputs, logits_to_keep=1)  # the routing is what counts; skip most of the head
    finally:
        for hook in hooks:
            hook.remove()


def train(tc: TrainConfig, on_step: Callable[[dict], None] | None = None) -> Path:
    """Run (or resume) the training described by `tc`; returns the run folder.

    `on_step(row)` sees every CSV row (the progress display uses it)."""
    from k3.model import K3ForCausalLM

    tc.check()
    cfg = load_model_config(tc.preset)
    if not cfg.num_experts:
        raise TrainError("--preset: the model has no MoE layers, nothing to balance or export as MXFP4")
    run = Path(tc.out)
    _prepare_run(tc, run)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    model = K3ForCausalLM.from_config(cfg, seed=tc.seed, quantized_experts=False)
    model.train()
    optimizer = build_optimizer(model, tc.optimizer, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2))
    routers = model.routers()
    moe_layers = sorted(routers)
    balancer = RoutingBalancer(
        moe_layers,
        cfg.num_experts,
        cfg.num_experts_per_token,
        tc.balance,
        tc.gamma,
        tc.balance_ema,
        tc.qb_iters,
    )
    data = make_dataset(tc, cfg)
    held_out = make_dataset(tc, cfg, stream=1) if tc.eval_every else None
    columns = log_columns(moe_layers, ["eval_loss", "eval_acc"] if tc.eval_every else [])

    start = 0
    checkpoints = list_checkpoints(run)
    if checkpoints:
        meta = load_training_state(checkpoints[-1][1], model, optimizer)
        start = meta["step"]
    for layer, router in routers.items():  # the bias lives in the router buffer; the balancer reads it
        balancer.biases[layer] = router.e_score_correction_bias.detach().clone()
    log_path, loads_path = run / LOG_FILE, run / LOADS_FILE
    _cut_log(log_path, columns, start)
    _cut_log(loads_path, ["step", "layer", *(f"e{e}" for e in range(cfg.num_experts))], start)

    autocast = tc.dtype == "bf16"
    tokens_per_step = tc.batch_size * tc.seq_len * tc.accum
    last = tc.steps if tc.stop_after is None else min(tc.steps, tc.stop_after)
    with log_path.open("a", newline="") as log_file, loads_path.open("a", newline="") as loads_file:
        writer, loads_writer = csv.DictWriter(log_file, fieldnames=columns), csv.writer(loads_file)
        for step in range(start, last):
            began = time.perf_counter()
            lr = learning_rate(step, tc.lr, tc.steps, tc.warmup, tc.schedule, tc.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = 0.0
            # the refresh below computes its own scores
            with record_routing(model, scores=not tc.balance_refresh, weights=False) as routing:
                for micro in range(tc.accum):
                    inputs, labels = data.batch(step * tc.accum + micro)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        logits = model(inputs)
                    loss = F.cross_entropy(
                        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE
                    )
                    (loss / tc.accum).backward()
                    loss_sum += float(loss.detach())
            if not math.isfinite(loss_sum):
                raise TrainError(f"step {step + 1}: the loss is {loss_sum}; lower --lr or use --clip")
            # with no clipping the norm is still measured (a max norm of inf scales every gradient by 1)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip or math.inf))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if tc.balance_refresh:
                refit_on_updated_model(model, balancer, data, step, tc)
            row: dict[str, float | int | str] = {
                "step": step + 1,
                "loss": repr(loss_sum / tc.accum),
                "lr": repr(lr),
            }
            worst = 0.0
            for layer in moe_layers:
                loads = chosen_loads(routing.indices(layer), cfg.num_experts)
                if not tc.balance_refresh:  # else the refresh above has fitted the biases already
                    balancer.fit(layer, routing.scores(layer), loads)
                routers[layer].e_score_correction_bias.copy_(balancer.biases[layer])
                loads_writer.writerow([step + 1, layer, *(int(n) for n in loads.tolist())])
                ratio = max_over_mean(loads)
                row[f"load_max_over_mean_L{layer}"] = f"{ratio:.6f}"
                worst = max(worst, ratio)
            row["max_over_mean_load"] = f"{worst:.6f}"
            row["grad_norm"] = f"{grad_norm:.6g}"
            if held_out is not None and ((step + 1) % tc.eval_every == 0 or step + 1 == tc.steps):
                eval_loss, eval_acc = evaluate(model, held_out, tc.eval_batches, autocast)
                row["eval_loss"], row["eval_acc"] = f"{eval_loss:.6f}", f"{eval_acc:.6f}"
            row["tokens_per_s"] = f"{tokens_per_step / (time.perf_counter() - began):.1f}"
            writer.writerow(row)
            log_file.flush()
            loads_file.flush()
            if on_step is not None:
                on_step(row)
            if (step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps:
                save_training_state(
                    run,
                    step + 1,
                    model,
                    optimizer,
                    {"tokens": (step + 1) * tokens_per_step},
                    tc.keep_checkpoints,
                )
    if last == tc.steps and tc.export:
        from k3.train.export import export_checkpoint

        export_checkpoint(model, cfg, run / EXPORT_DIR, tokenizer_dir=tc.tokenizer)
    return run
