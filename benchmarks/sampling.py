"""The engine's draw of a sampled token against torch.multinomial, its peer, at `mini`'s and K3's vocabulary.

    python benchmarks/sampling.py [--vocab 32768 163840] [--scale 3 6] [--draws 100] [--threads 1]

For each vocabulary size and logit scale (logits normal with standard deviation `--scale`: the larger, the
more peaked the distribution and the smaller top-p's nucleus, whose size is printed): the draw alone
(probabilities [V] in, one token out) by `inverse_cdf_draw` (a running sum in fp64, one uniform number) and by
`torch.multinomial(p, 1, generator=...)` (the engine's draw before: V exponentials), with the rate the draw
reads the probabilities at against this machine's streaming read bandwidth; top-p 0.9's `nucleus` against a
sort of the whole vocabulary (the engine's before); then the engine's whole `draw` at temperature 1, top-p 1
and 0.9, against the same `draw` with the two parts before. Medians of `--draws` calls. The two draws are
distributed alike (tests/engine/test_sampling.py), not token for token: they use the generator differently.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from k3.engine import sampling
from k3.engine.sampling import SamplingParams, draw, inverse_cdf_draw, nucleus
from k3.ops.roofline import call_seconds, machine_line, read_bandwidth


def median_seconds(fn, draws: int) -> float:
    return statistics.median(call_seconds(fn, draws))


def multinomial_draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 163840])
    ap.add_argument("--scale", type=float, nargs="+", default=[3.0, 6.0])
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine samples on its own)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    generator = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for scale in args.scale:
            measure(vocab, scale, generator, bandwidth, args.draws)


def sorted_nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by a sort of the whole vocabulary: the engine's before `nucleus`."""
    top, order = torch.sort(logp, descending=True)
    probs = top.exp()
    kept = torch.cumsum(probs, -1) - probs < top_p
    return torch.zeros(logp.numel(), dtype=torch.bool).scatter(0, order, kept)


def measure(vocab: int, scale: float, generator: torch.Generator, bandwidth: float, draws: int) -> None:
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    probs = torch.softmax(logits, 0)
    logp = torch.log_softmax(logits, 0)
    ours = median_seconds(lambda: inverse_cdf_draw(probs, generator), draws)
    peer = median_seconds(lambda: multinomial_draw(probs, generator), draws)
    rate = probs.nbytes / ours / 1e9
    size = int(nucleus(logp, 0.9).sum())
    print(
        f"V = {vocab:,}, logits N(0, {scale:g}^2), top-p 0.9 keeps {size:,}: "
        f"the draw alone {ours * 1e3:.3f} ms "
        f"(reads p at {rate:.1f} GB/s, {rate / (bandwidth / 1e9):.0%} of read), torch.multinomial "
        f"{peer * 1e3:.3f} ms: {peer / ours:.1f}x"
    )
    ours = median_seconds(lambda: nucleus(logp, 0.9), draws)
    peer = median_seconds(lambda: sorted_nucleus(logp, 0.9), draws)
    print(f"  the nucleus {ours * 1e3:.3f} ms, by a full sort {peer * 1e3:.3f} ms: {peer / ours:.1f}x")
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)):
        engine = median_seconds(lambda p=params: draw(logits, p, generator), draws)
        sampling.inverse_cdf_draw, sampling.nucleus = multinomial_draw, sorted_nucleus  # the draw before
        try:
            before = median_seconds(lambda p=params: draw(logits, p, generator), draws)
        finally:
            sampling.inverse_cdf_draw, sampling.nucleus = inverse_cdf_draw, nucleus
        print(
            f"  the engine's draw, temperature 1, top_p {params.top_p}: {engine * 1e3:.3f} ms, as before "
            f"{before * 1e3:.3f} ms: {before / engine:.2f}x"
        )


if __name__ == "__main__":
    main()
