"""The training loop on the tiny preset: bitwise resume after a stop or a SIGKILL, balance methods, MXFP4
export, the CLI and the plots. Runs are a few steps of 2 x 32 tokens."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from k3.train.optim import build_optimizer
from k3.train.trainer import TrainConfig, TrainError, train


def tiny(out: Path, **overrides) -> TrainConfig:
    settings = dict(
        preset="tiny",
        data="mqar",
        out=str(out),
        steps=6,
        batch_size=2,
        seq_len=32,
        num_kv_pairs=4,
        warmup=2,
        checkpoint_every=2,
        progress=False,
        export=False,
        threads=1,
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def column(run: Path, name: str, file: str = "log.csv") -> list[str]:
    with (run / file).open(newline="") as f:
        return [row[name] for row in csv.DictReader(f)]


def rows(run: Path, file: str) -> list[list[str]]:
    with (run / file).open(newline="") as f:
        return list(csv.reader(f))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    return train(tiny(tmp_path_factory.mktemp("straight") / "run", export=True))


def test_stop_and_resume_reproduces_the_losses_bitwise(uninterrupted: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(run, stop_after=3))  # checkpoint at step 2, step 3 logged but not checkpointed
    assert column(run, "step") == ["1", "2", "3"]
    train(tiny(run))
    assert column(run, "step") == [str(i) for i in range(1, 7)]
    assert column(run, "loss") == column(uninterrupted, "loss")  # repr of the float: bitwise
    assert column(run, "grad_norm") == column(uninterrupted, "grad_norm")
    assert rows(run, "loads.csv") == rows(uninterrupted, "loads.csv")
    # the losses change from step to step: equal columns are not an accident of a constant
    assert len(set(column(run, "loss"))) == 6


def test_sigkill_while_writing_a_checkpoint_then_resume(uninterrupted: Path, tmp_path: Path) -> None:
    """The process dies between writing the model and the optimizer file of the step-4 checkpoint."""
    run = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import json, os, signal
        import k3.train.state as state
        from k3.train.trainer import TrainConfig, train
        real, calls = state.save_file, []
        def dying_save_file(tensors, path):
            calls.append(path)
            if len(calls) == 3:  # 1, 2: checkpoint 2; 3: the model file of checkpoint 4
                real(tensors, path)
                os.kill(os.getpid(), signal.SIGKILL)
            real(tensors, path)
        state.save_file = dying_save_file
        train(TrainConfig(**json.loads({json.dumps(tiny(run).__dict__)!r})))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == [
        ".tmp-step-00000004",
        "step-00000002",
    ]
    train(tiny(run))
    assert column(run, "loss") == column(uninterrupted, "loss")
    assert not (run / "checkpoints" / ".tmp-step-00000004").exists()


def test_muon_run_resumes_bitwise_and_differs_from_adamw(uninterrupted: Path, tmp_path: Path) -> None:
    straight = train(tiny(tmp_path / "straight", optimizer="muon"))
    run = tmp_path / "run"
    train(tiny(run, optimizer="muon", stop_after=3))
    train(tiny(run, optimizer="muon"))
    assert column(run, "loss") == column(straight, "loss")
    assert column(run, "grad_norm") == column(straight, "grad_norm")
    # same data and weights at step 1, another optimizer from there on
    assert column(straight, "loss")[0] == column(uninterrupted, "loss")[0]
    assert column(straight, "loss")[1:] != column(uninterrupted, "loss")[1:]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest() -> None:
    from k3.config import K3Config
    from k3.model import K3ForCausalLM

    model = K3ForCausalLM.from_config(K3Config.preset("tiny"), seed=0, quantized_experts=False)
    pair = build_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.95))
    muon, adamw = pair.parts
    in_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        hidden = p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name
        assert (id(p) in in_muon) == hidden, name
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    # one state dict in torch's format, parameters numbered across both, and back
    model(torch.randint(0, 100, (1, 8))).sum().backward()
    pair.step()
    state = pair.state_dict()
    numbered = sorted(i for g in state["param_groups"] for i in g["params"])
    assert numbered == list(range(len(numbered)))
    assert set(state["state"]) <= set(numbered) and len(state["state"]) > len(numbered) // 2
    fresh = build_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.95))
    fresh.load_state_dict(state)
    for before, after in zip(pair.parts, fresh.parts, strict=True):
        for p in (p for g in before.param_groups for p in g["params"]):
            for key, value in before.state[p].items():
                assert torch.equal(value, after.state[p][key]), key


def test_resuming_with_other_settings_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=2, checkpoint_every=1))
    with pytest.raises(TrainError, match="lr"):
        train(tiny(run, steps=2, lr=5e-4))


def test_balance_methods_leave_their_mark_on_the_biases(tmp_path: Path) -> None:
    def final_biases(method: str) -> tuple[Path, dict[int, torch.Tensor]]:
        run = train(tiny(tmp_path / method, steps=3, checkpoint_every=3, balance=method))
        state = load_file(str(run / "checkpoints" / "step-00000003" / "model.safetensors"))
        return run, {
            int(k.split(".")[2]): v for k, v in state.items() if k.endswith("e_score_correction_bias")
        }

    _, none = final_biases("none")
    assert sorted(none) == [1, 2, 3, 4] and all(torch.equal(b, torch.zeros_like(b)) for b in none.values())
    # DeepSeek: replay b += 1e-3 sign(mean - load) from the loads the run logged
    run, deepseek = final_biases("deepseek")
    expected = {layer: torch.zeros(8) for layer in deepseek}
    for _step, layer, *loads in rows(run, "loads.csv")[1:]:
        load = torch.tensor([float(n) for n in loads])
        expected[int(layer)] += 1e-3 * torch.sign(load.mean() - load)
    for layer, b in deepseek.items():
        torch.testing.assert_close(b, expected[layer], rtol=0, atol=1e-7)
    assert any(b.abs().max() > 0 for b in deepseek.values())
    _, qb = final_biases("qb")
    for b in qb.values():
        assert b.abs().max() > 0 and abs(float(b.mean())) < 1e-6  # mean-centred


def test_balance_refresh_fits_the_batch_as_the_updated_model_routes_it(tmp_path: Path) -> None:
    """After step 1 with --balance-refresh, each layer's bias is QB's exact fit of step 1's batch routed by
    the model after step 1, with the layers below already routed by their refitted biases. Reproduced here
    one layer at a time, one forward per layer; without refresh the biases differ."""
    from k3.model import K3ForCausalLM
    from k3.model.moe import Router
    from k3.train.routing import quantile_balance_bias
    from k3.train.state import load_model_state
    from k3.train.trainer import load_model_config, make_dataset

    def step_one(refresh: bool) -> tuple[TrainConfig, dict[int, torch.Tensor]]:
        run = tmp_path / f"refresh-{refresh}"
        tc = tiny(run, steps=2, accum=2, checkpoint_every=1, qb_iters=200, balance_refresh=refresh)
        train(tc)
        state = load_file(str(run / "checkpoints" / "step-00000001" / "model.safetensors"))
        return tc, {
            int(k.split(".")[2]): v for k, v in state.items() if k.endswith("e_score_correction_bias")
        }

    tc, refreshed = step_one(True)
    _, stale = step_one(False)
    cfg = load_model_config(tc.preset)
    model = K3ForCausalLM.from_config(cfg, seed=tc.seed, quantized_experts=False)
    load_model_state(tmp_path / "refresh-True" / "checkpoints" / "step-00000001", model)
    data = make_dataset(tc, cfg)
    batch = torch.cat([data.batch(0)[0], data.batch(1)[0]])  # step 1's two micro-batches
    routers = {int(name.split(".")[2]): m for name, m in model.named_modules() if isinstance(m, Router)}
    assert sorted(routers) == sorted(refreshed) == [1, 2, 3, 4]
    for router in routers.values():
        router.e_score_correction_bias.zero_()  # the bias every layer had during step 1
    for layer in sorted(routers):
        seen = []
        hook = routers[layer].register_forward_hook(lambda m, args, out, seen=seen: seen.append(args[0]))
        with torch.no_grad():
            model(batch)
        hook.remove()
        scores = torch.sigmoid(seen[0] @ routers[layer].weight.t())
        expected = quantile_balance_bias(scores, cfg.num_experts_per_token, iters=200)
        torch.testing.assert_close(refreshed[layer], expected, rtol=0, atol=1e-5)
        assert (stale[layer] - expected).abs().max() > 1e-3
        routers[layer].e_score_correction_bias.copy_(expected)
    # stopped after step 1 and resumed: the refitted biases come back from the checkpoint, bit for bit
    resumed = tmp_path / "resumed"
    train(
        tiny(resumed, steps=2, accum=2, checkpoint_every=1, qb_iters=200, balance_refresh=True, stop_after=1)
    )
    train(tiny(resumed, steps=2, accum=2, checkpoint_every=1, qb_iters=200, balance_refresh=True))
    assert column(resumed, "loss") == column(tmp_path / "refresh-True", "loss")
    assert rows(resumed, "loads.csv") == rows(tmp_path / "refresh-True", "loads.csv")
    with pytest.raises(TrainError, match="balance-refresh"):
        train(tiny(tmp_path / "ds", balance="deepseek", balance_refresh=True))


def test_export_is_a_published_mxfp4_checkpoint(uninterrupted: Path) -> None:
    from k3.checkpoint import open_checkpoint
    from k3.model import K3ForCausalLM
    from k3.ops.mxfp4 import quantize_mxfp4

    trained = load_file(str(uninterrupted / "checkpoints" / "step-00000006" / "model.safetensors"))
    export = uninterrupted / "export"
    with open_checkpoint(export) as ckpt:
        prefix = "language_model.model.layers.1.block_sparse_moe."
        packed = ckpt.read(prefix + "experts.3.w1.weight_packed")
        scale = ckpt.read(prefix + "experts.3.w1.weight_scale")
        want_packed, want_scale = quantize_mxfp4(
            trained["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
        )
        assert (
            packed.dtype == torch.uint8
            and torch.equal(packed, want_packed)
            and torch.equal(scale, want_scale)
        )
        bias = ckpt.read(prefix + "gate.e_score_correction_bias")
        assert bias.dtype == torch.float32
        assert torch.equal(bias, trained["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"])
        assert bias.abs().max() > 0  # the QB bias, not a fresh zero
    model = K3ForCausalLM.from_pretrained(export)
    logits = model(torch.randint(1, 1024, (1, 8)))
    assert torch.isfinite(logits).all()
    assert (export / "tiktoken.model").is_file()


def test_cli_trains_and_plots(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from k3.train.commands import train_app

    run = tmp_path / "run"
    args = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--num-kv-pairs", "4", "--warmup", "1"]
    result = CliRunner().invoke(train_app, [*args, "--out", str(run), "--quiet", "--no-export"])
    assert result.exit_code == 0, result.output
    assert column(run, "step") == ["1", "2"]
    result = CliRunner().invoke(train_app, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    for name in ("loss.png", "load_balance.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = CliRunner().invoke(train_app, ["--balance", "aux", "--out", str(tmp_path / "bad"), "--quiet"])
    assert result.exit_code == 2  # typer refuses it (tests/train/test_commands.py)
    bad = ["--balance", "deepseek", "--balance-refresh", "--out", str(tmp_path / "bad"), "--quiet"]
    result = CliRunner().invoke(train_app, bad)
    assert result.exit_code == 1 and "--balance-refresh: applies to --balance qb only" in result.output


def test_a_run_shorter_than_its_warmup_runs_and_says_it_once(tmp_path: Path, capsys) -> None:
    train(tiny(tmp_path / "short", steps=3, warmup=10, checkpoint_every=3))
    err = capsys.readouterr().err
    assert err.count("warm-up clipped to the run's 3 steps") == 1
    assert column(tmp_path / "short", "step") == ["1", "2", "3"]
    lrs = [float(x) for x in column(tmp_path / "short", "lr")]
    assert lrs[0] < lrs[1] < lrs[2]  # still warming up: the warm-up spans the 3 steps


def test_more_steps_continue_a_finished_run_and_fewer_are_refused(
    uninterrupted: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    train(tiny(run, steps=4))
    four = column(run, "lr")
    assert four != column(uninterrupted, "lr")[:4]  # a 4-step schedule, not the 6-step run's
    train(tiny(run, steps=6))
    assert column(run, "step") == [str(s) for s in range(1, 7)]
    assert column(run, "lr")[:4] == four  # continued from step 4, not started again on 6 steps
    assert (run / "checkpoints" / "step-00000006").is_dir()
    with pytest.raises(TrainError, match="already trained 6 steps"):
        train(tiny(run, steps=5))
