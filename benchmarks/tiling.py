"""One-token decode steps of a checkpoint with its BF16 weights tiled for the decode kernels (k3.model.tiling)
against the same weights in rows, alternated in one process, each round with the read bandwidth of the moment.

    .venv/bin/python benchmarks/tiling.py --checkpoint /path/to/k3-slice --threads 2
    .venv/bin/python benchmarks/tiling.py --checkpoint CKPT --batch 1,8 --rounds 3 --steps 6

The model is loaded once (BF16 weights as stored, fp32 computation) and one cache per batch size prefilled to
about `--context` tokens; then each round re-lays the weights (untile, or tile: a few seconds, not timed),
times `--steps` decode steps per batch size (median, after `--warmup` untimed ones), and reads a 512 MiB
buffer: the floor of a step is the bytes of weights one sequence's token reads (benchmarks/decode.py's
component_bytes) over that read rate. The order of the two layouts alternates between rounds. The logits
of both are the same bits (tests/model/test_tiling.py); only the time differs. On a shared machine the
read rate moves between rounds by tens of %: compare within a round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from decode import component_bytes, prefilled

from k3.model import K3ForCausalLM
from k3.model.cache import ModelCache
from k3.ops.roofline import machine_line, read_bandwidth


def step_ms(model: K3ForCausalLM, cache: ModelCache, batch: int, steps: int, warmup: int) -> float:
    """Median ms of `steps` decode steps of the `batch` sequences in `cache` after `warmup` untimed ones."""
    token = torch.ones(batch, 1, dtype=torch.long)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        model(token, cache)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a checkpoint with BF16 weights (e.g. k3-slice)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512, help="tokens in each sequence's cache first")
    ap.add_argument("--batch", default="1,8", help="batch sizes, e.g. 1,8")
    ap.add_argument("--steps", type=int, default=5, help="timed decode steps per batch size and round")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first (after a re-lay)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (tiled, rows) or (rows, tiled)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    model = K3ForCausalLM.from_pretrained(args.checkpoint, compute_dtype=torch.float32)
    floor_bytes = sum(component_bytes(model).values())
    print(machine_line())
    print(f"{args.checkpoint}: {floor_bytes / 1e9:.3f} GB of weights a sequence's token reads")
    caches = {b: prefilled(model, b, args.context, torch.Generator().manual_seed(b)) for b in batches}
    for r in range(args.rounds):
        order = ("tiled", "rows") if r % 2 == 0 else ("rows", "tiled")
        figures = {}
        for layout in order:
            moved = model.tile_weights() if layout == "tiled" else model.untile_weights()
            figures[layout] = {b: step_ms(model, caches[b], b, args.steps, args.warmup) for b in batches}
            print(f"  round {r + 1} {layout:>5} ({moved / 1e9:.2f} GB re-laid): ", end="")
            print(", ".join(f"B = {b} {ms:.1f} ms" for b, ms in figures[layout].items()), flush=True)
        read = read_bandwidth()
        floor_ms = 1e3 * floor_bytes / read
        one = batches[0]
        tiled, rows = figures["tiled"][one], figures["rows"][one]
        load = os.getloadavg()[0]
        print(f"round {r + 1}: read {read / 1e9:.1f} GB/s, floor {floor_ms:.1f} ms; load {load:.1f}")
        print(
            f"  B = {one}: tiled {tiled:.1f} ms ({100 * floor_ms / tiled:.0f} % of the floor), "
            f"rows {rows:.1f} ms ({100 * floor_ms / rows:.0f} %): tiled {rows / tiled:.2f}x",
            flush=True,
        )
        for b in batches[1:]:
            t, w = figures["tiled"][b], figures["rows"][b]
            print(f"  B = {b}: tiled {b * 1e3 / t:.1f} tokens/s, rows {b * 1e3 / w:.1f}: {w / t:.2f}x")


if __name__ == "__main__":
    main()
