"""`k3 rl export RUN OUT`: the latest policy of an RL run (or a policy folder) in the published layout,
through k3.train.export (routed experts MXFP4, the built-in tokenizer beside the weights)."""

from __future__ import annotations

from pathlib import Path

from k3.errors import K3Error


class ExportError(K3Error):
    """A folder with no policy to export."""


def export_run(run: str | Path, out: str | Path) -> Path:
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.rl.policy_io import POLICY_FILE, load_policy
    from k3.train.export import export_checkpoint
    from k3.train.state import list_checkpoints, load_model_state

    run = Path(run)
    if (run / POLICY_FILE).is_file():
        model = load_policy(str(run))
    else:
        checkpoints = list_checkpoints(run)
        if not checkpoints or not (run / "config.json").is_file():
            raise ExportError(f"{run}: no RL checkpoint (checkpoints/step-N and config.json) to export")
        cfg = K3Config.from_pretrained(str(run / "config.json"))
        model = K3ForCausalLM.from_config(cfg, quantized_experts=False)
        load_model_state(checkpoints[-1][1], model)
    return export_checkpoint(model, model.config, out)
