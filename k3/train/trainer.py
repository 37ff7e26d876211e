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
uninterrupted run's bit for bit. A larger `--steps` continues a finished run from its last checkpoint, on
the schedule of the new length (the steps already taken keep the rates they had). A run shorter than its
warm-up warms up over all of it (said once).

Routing balance needs each MoE layer's router scores for the batch: the trainer records them, with the
chosen experts, through `record_routing` (k3.model.routing), as the routers computed them. After the
optimizer step the balancer turns them into new biases, written to the routers' `e_score_correction_bias`
buffers; so the bias a batch is routed with comes from earlier batches only.

With several processes (`--nproc N`, or started by torchrun) the routed experts are sharded over the ranks
(`--expert-parallel N`, dispatch as `--ep-policy` plans it, see k3.dist): each rank holds only its own
experts' weights, gradients and optimizer state. Everything else is data parallel: each rank takes its
share of the global `--batch-size`, the replicated gradients are summed over ranks, the gradient norm is
the whole model's and the routing balance sees the whole batch, so the run equals one process to
rounding. Every rank writes its experts into each checkpoint (k3.train.state), which resumes on any number
of processes; rank 0 writes the rest of the files, and the export from the final checkpoint.

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
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from k3.config import K3Config
from k3.dist.group import torchrun_env
from k3.dist.moe import STATS_COLUMNS
from k3.model.routing import record_routing
from k3.train.config import TrainConfig, TrainError
from k3.train.data import IGNORE, MQAR, Copying, Dataset, TextFile, answer_accuracy
from k3.train.optim import build_optimizer
from k3.train.routing import RoutingBalancer, chosen_loads, max_over_mean
from k3.train.schedule import pretraining_rate
from k3.train.state import (
    CheckpointTensors,
    Writers,
    cut_log,
    list_checkpoints,
    load_training_state,
    save_training_state,
    write_run_config,
)

TRAIN_JSON = "train.json"
LOG_FILE = "log.csv"
LOADS_FILE = "loads.csv"
EP_FILE = "expert_parallel.csv"  # with several processes: per step, micro-batch and layer (k3.dist.moe)
EXPORT_DIR = "export"
# Fields that may change between a run and its resumption without changing what is computed.
_RESUMABLE_CHANGES = {"stop_after", "progress", "export", "nproc", "expert_parallel", "ep_policy", "ep_slots"}
_RESUMABLE_CHANGES |= {"ep_replan_every", "ep_timeout", "ep_threshold"}
_RESUMABLE_CHANGES |= {"steps"}  # a larger --steps continues a finished run (the schedule of the new length)


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
    model: nn.Module, balancer: RoutingBalancer, data: Dataset, step: int, tc: TrainConfig, par=None
) -> None:
    """Route step `step`'s micro-batches again, as one batch, with the model as it is now (after the
    optimizer step); each router fits its bias to the batch just before routing it, so layer l sees its
    input as routed by the refitted biases of the layers below. With several processes (`par`, a
    k3.dist DataParallel) each rank routes its rows and the fit sees every rank's scores, in the order of
    the one-process batch."""

    def fit_then_route(layer: int) -> Callable:
        def pre_hook(router: nn.Module, args: tuple) -> None:
            with torch.no_grad():
                scores = router.scores(args[0])  # [rows, E]
                balancer.fit(layer, scores if par is None else par.gather_micro(scores, tc.accum))
            router.e_score_correction_bias.copy_(balancer.biases[layer])

        return pre_hook

    shard = (lambda rows: rows) if par is None else par.shard
    inputs = torch.cat([shard(data.batch(step * tc.accum + micro)[0]) for micro in range(tc.accum)])
    routers = model.routers().items()
    hooks = [router.register_forward_pre_hook(fit_then_route(layer)) for layer, router in routers]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.dtype == "bf16"):
            model(inputs, logits_to_keep=1)  # the routing is what counts; skip most of the head
    finally:
        for hook in hooks:
            hook.remove()


def _start_parallel(tc: TrainConfig, cfg: K3Config):
    """The data/expert-parallel setup under torchrun (None in one process); checks the settings first."""
    from k3.dist.data_parallel import DataParallel, cpu_threads

    world = int(os.environ["WORLD_SIZE"])
    if world == 1 and tc.expert_parallel in (0, 1):
        return None
    if tc.expert_parallel not in (0, world):
        raise TrainError(
            f"--expert-parallel: shards the experts over all {world} processes; got {tc.expert_parallel}"
        )
    if tc.batch_size % world:
        raise TrainError(f"--batch-size: {tc.batch_size} sequences do not divide over {world} processes")
    if cfg.num_experts % world:
        raise TrainError(f"--expert-parallel: {cfg.num_experts} experts do not divide over {world} processes")
    par = DataParallel.start(tc.ep_policy, tc.ep_slots, tc.ep_timeout, tc.ep_threshold)
    if not tc.threads:
        torch.set_num_threads(cpu_threads(world))
    return par


def _read_loads(path: Path, first: int, last: int) -> dict[int, torch.Tensor]:
    """Tokens per expert summed over steps first..last of RUN/loads.csv, per MoE layer."""
    summed: dict[int, torch.Tensor] = {}
    if path.is_file():
        with path.open(newline="") as f:
            for row in csv.reader(f):
                if row and row[0].isdigit() and first <= int(row[0]) <= last:
                    loads = torch.tensor([float(v) for v in row[2:]])
                    summed[int(row[1])] = summed.get(int(row[1]), 0) + loads
    return summed


def train(tc: TrainConfig, on_step: Callable[[dict], None] | None = None) -> Path:
    """Run (or resume) the training described by `tc`; returns the run folder.

    `on_step(row)` sees every CSV row (the progress display uses it). With `nproc` > 1 (and not already
    under torchrun) the run is launched on that many processes through torch.distributed.run."""
    from k3.model import K3ForCausalLM

    tc.check()
    cfg = load_model_config(tc.preset)
    if not cfg.num_experts:
        raise TrainError("--preset: the model has no MoE layers, nothing to balance or export as MXFP4")
    run = Path(tc.out)
    if tc.nproc > 1 and not torchrun_env():
        from k3.dist.launch import launch

        write_run_config(tc, run / TRAIN_JSON, _RESUMABLE_CHANGES, TrainError)
        launch(tc.nproc, ["-m", "k3.train.trainer", str(run / TRAIN_JSON)])
        return run
    if tc.expert_parallel > 1 and not torchrun_env():
        raise TrainError(
            f"--expert-parallel {tc.expert_parallel}: needs --nproc {tc.expert_parallel} (or torchrun)"
        )
    par = _start_parallel(tc, cfg) if torchrun_env() else None
    writes = par is None or par.writes
    if writes:
        write_run_config(tc, run / TRAIN_JSON, _RESUMABLE_CHANGES, TrainError)
    warmup = min(tc.warmup, tc.steps)  # a run shorter than its warm-up warms up over all of it
    if writes and warmup < tc.warmup:
        print(
            f"k3 train: warm-up clipped to the run's {tc.steps} steps (--warmup {tc.warmup})", file=sys.stderr
        )
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    writers, elsewhere = None, None
    if par is None:
        model = K3ForCausalLM.from_config(cfg, seed=tc.seed, quantized_experts=False)
    else:
        from k3.dist.shard import is_expert_name, sharded_model

        model = sharded_model(cfg, seed=tc.seed, rank=par.rank, world=par.world, quantized_experts=False)
        par.install(model)
        writers = Writers(par.rank, par.world, par.barrier, lambda name: not is_expert_name(name))
        elsewhere = is_expert_name  # the experts of the other ranks, in a checkpoint
    model.train()
    betas = (tc.beta1, tc.beta2)
    optimizer = build_optimizer(model, tc.optimizer, tc.lr, tc.weight_decay, betas, tc.muon_fp32)
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
        meta = load_training_state(checkpoints[-1][1], model, optimizer, elsewhere)
        start = meta["step"]
        if start > tc.steps:
            raise TrainError(f"--steps {tc.steps}: {run} has already trained {start} steps (ask for more)")
    for layer, router in routers.items():  # the bias lives in the router buffer; the balancer reads it
        balancer.biases[layer] = router.e_score_correction_bias.detach().clone()
    log_path, loads_path = run / LOG_FILE, run / LOADS_FILE
    eplb = par is not None and tc.ep_policy == "eplb"
    if eplb:  # EPLB places replicas every ep_replan_every steps, from the loads of the steps before
        every = tc.ep_replan_every
        placed = start - start % every if start % every else start - every  # the last placement's window
        per_micro = every * tc.accum  # EPLB plans from pairs per micro-batch, averaged over the window
        par.ep.history = {
            layer: (v / per_micro).numpy()
            for layer, v in _read_loads(loads_path, placed - every + 1, placed).items()
        }
        recent = _read_loads(loads_path, placed + 1, start)  # the loads the next placement starts from
    if writes:
        cut_log(log_path, columns, start)
        cut_log(loads_path, ["step", "layer", *(f"e{e}" for e in range(cfg.num_experts))], start)
        if par is not None:
            cut_log(run / EP_FILE, STATS_COLUMNS, start)
    else:  # rank 0 writes the run's files; the others write nowhere
        log_path = loads_path = Path(os.devnull)
    if par is not None:
        par.barrier()

    autocast = tc.dtype == "bf16"
    tokens_per_step = tc.batch_size * tc.seq_len * tc.accum
    last = tc.steps if tc.stop_after is None else min(tc.steps, tc.stop_after)
    with log_path.open("a", newline="") as log_file, loads_path.open("a", newline="") as loads_file:
        writer, loads_writer = csv.DictWriter(log_file, fieldnames=columns), csv.writer(loads_file)
        for step in range(start, last):
            began = time.perf_counter()
            lr = pretraining_rate(step, tc.lr, tc.steps, warmup, tc.schedule, tc.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if eplb and step % tc.ep_replan_every == 0 and step:
                per_micro = tc.ep_replan_every * tc.accum
                par.ep.history, recent = {layer: (v / per_micro).numpy() for layer, v in recent.items()}, {}
            if par is not None:
                par.ep.stats.clear()  # the evaluation's forwards of the step before
            loss_sum = 0.0
            # the refresh below computes its own scores
            with record_routing(model, scores=not tc.balance_refresh, weights=False) as routing:
                for micro in range(tc.accum):
                    inputs, labels = data.batch(step * tc.accum + micro)
                    if par is not None:  # this rank's rows; the loss is its share of the global mean
                        counted = max(1, int((labels != IGNORE).sum()))
                        inputs, labels = par.shard(inputs), par.shard(labels)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        logits = model(inputs)
                    flat_logits, flat_labels = logits.float().flatten(0, 1), labels.flatten()
                    if par is None:
                        loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE)
                    else:
                        loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE, reduction="sum")
                        loss = loss / counted
                    (loss / tc.accum).backward()
                    loss_sum += float(loss.detach())
            if par is not None:
                par.reduce_gradients(model)
                loss_sum = par.sum(loss_sum)
                if writes:
                    with (run / EP_FILE).open("a", newline="") as f:
                        csv.DictWriter(f, fieldnames=STATS_COLUMNS).writerows(par.ep.stats_rows(step + 1))
            if not math.isfinite(loss_sum):
                raise TrainError(f"step {step + 1}: the loss is {loss_sum}; lower --lr or use --clip")
            # with no clipping the norm is still measured (a max norm of inf scales every gradient by 1)
            if par is None:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.clip or math.inf))
            else:
                grad_norm = par.clip_gradients(model, tc.clip or math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if tc.balance_refresh:
                refit_on_updated_model(model, balancer, data, step, tc, par)
            row: dict[str, float | int | str] = {
                "step": step + 1,
                "loss": repr(loss_sum / tc.accum),
                "lr": repr(lr),
            }
            worst = 0.0
            for layer in moe_layers:
                indices = routing.indices(layer) if par is None else par.gather(routing.indices(layer))
                loads = chosen_loads(indices, cfg.num_experts)
                if eplb:
                    recent[layer] = recent.get(layer, 0) + loads
                if not tc.balance_refresh:  # else the refresh above has fitted the biases already
                    scores = (
                        routing.scores(layer)
                        if par is None or tc.balance != "qb"
                        else par.gather(routing.scores(layer))
                    )
                    balancer.fit(layer, scores, loads)
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
            if on_step is not None and writes:
                on_step(row)
            if par is not None and writes and tc.progress:
                print(f"step {step + 1}/{tc.steps}  loss {loss_sum / tc.accum:.4f}", flush=True)
            if (step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps:
                save_training_state(
                    run,
                    step + 1,
                    model,
                    optimizer,
                    {"tokens": (step + 1) * tokens_per_step},
                    tc.keep_checkpoints,
                    writers,
                )
    if last == tc.steps and tc.export and writes:
        from k3.train.export import export_checkpoint

        # with sharded experts, from the final checkpoint: every rank's experts, one tensor at a time
        state = None if par is None else CheckpointTensors(list_checkpoints(run)[-1][1])
        export_checkpoint(model, cfg, run / EXPORT_DIR, tokenizer_dir=tc.tokenizer, state=state)
    if par is not None:
        par.barrier()  # nobody leaves before rank 0 has written everything
        par.close()
    return run


if __name__ == "__main__":  # python -m k3.train.trainer RUN/train.json (what `--nproc N` launches)
    import sys

    train(TrainConfig(**json.loads(Path(sys.argv[1]).read_text())))
