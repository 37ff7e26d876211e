"""Holding an engine's returned logprobs against k3's, and the report: a terminal table, JSON, markdown.

Per generated (or echoed) position the engine returns its chosen token's logprob and its top-k; k3 knows
the exact distribution there (k3.conform.reference). The position agrees when every token of the engine's
top-k that k3 knows differs by at most the threshold (|dlogprob|), and the engine's most likely token is
one of k3's best (within the threshold of k3's maximum: a near-tie is not a parting). Where k3's routers
nearly tie before a position, a request is held against the outcome of those ties it agrees with best
(k3.conform.reference), and the report says which (`near_ties`): the engine rounded the other way, not a
state bug.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from k3.conform.reference import Expected

# max |dlogprob| allowed per expert format of the engine (docs/conform.md): an engine that computes the
# checkpoint's numbers exactly parts by float rounding; llama.cpp's CPU MXFP4 path rounds activations to
# 8 bits (docs/llamacpp.md: logits up to ~0.7 of their scale on random weights), so only gross breaks show.
THRESHOLDS = {"exact": 2e-3, "f16-cache": 1e-2, "q8-activations": 1.0}


@dataclass
class Returned:
    """What the engine said about one position: its token, that token's logprob, its top-k."""

    token: int
    logprob: float
    top: dict[int, float]  # token id -> logprob (ids the client could not map are left out)


@dataclass
class Parting:
    request: str  # which request of the scenario
    position: int  # index in the request's token sequence (prompt + generated) of the token predicted
    engine_token: str
    k3_token: str
    dlogprob: float


@dataclass
class ScenarioResult:
    name: str
    passed: bool = True
    requests: int = 0
    positions: int = 0
    max_dlogprob: float = 0.0
    top1_agree: int = 0
    parting: Parting | None = None
    notes: list[str] = field(default_factory=list)
    near_ties: list[str] = field(default_factory=list)  # requests held against another outcome of a near-tie
    unscored: int = 0  # generated tokens the engine gave no logprob for (NaN: llama.cpp's partial UTF-8)
    skipped: str | None = None  # why the scenario did not run

    @property
    def top1(self) -> float:
        return self.top1_agree / self.positions if self.positions else 1.0

    def fail(self, note: str) -> None:
        self.passed = False
        self.notes.append(note)

    def to_json(self) -> dict:
        out = asdict(self)
        out["top1"] = self.top1
        return out


def _distance(got: Returned, want: Expected, threshold: float) -> tuple[float, bool]:
    """max |dlogprob| over the engine's tokens that k3 knows, and whether its best token is one of k3's."""
    d = 0.0
    for token, lp in [(got.token, got.logprob), *got.top.items()]:
        ref = want.logprob(token)
        if ref is not None:
            d = max(d, abs(lp - ref))
    engine_best = max(got.top, key=got.top.get) if got.top else got.token
    ref_best = want.logprob(engine_best)
    return d, ref_best is not None and ref_best >= want.best - threshold


def _outcome(want: Expected, flipped: tuple) -> Expected:
    """k3's distribution under the near-tie outcome `flipped` (k3's own where the ties come later)."""
    return want if not flipped else next((e for f, e in want.variants if f == flipped), want)


def hold(
    result: ScenarioResult,
    request: str,
    returned: list[Returned],
    expected: list[Expected],
    positions: list[int],
    threshold: float,
    text,
) -> None:
    """Compare the engine's positions with k3's; `text(token)` names a token for the report."""
    result.requests += 1
    outcomes = [(), *dict.fromkeys(f for want in expected for f, _ in want.variants)]

    def cost(flipped: tuple) -> tuple[int, float]:  # (positions parted, max |dlogprob|)
        pairs = zip(returned, expected, strict=True)
        pairs = [(got, want) for got, want in pairs if not math.isnan(got.logprob)]
        scored = [_distance(got, _outcome(want, flipped), threshold) for got, want in pairs]
        parted = sum(d > threshold or not agree for d, agree in scored)
        return parted, max((d for d, _ in scored), default=0.0)

    # another outcome only where it explains the whole request (and k3's own does not): a request that
    # parts for another reason is reported against k3's own routing
    costs = {f: cost(f) for f in outcomes}
    flipped = min(outcomes, key=costs.__getitem__)
    if costs[()][0] == 0 or costs[flipped][0] > 0:
        flipped = ()
    if flipped:
        ties = ", ".join(f"layer {t.layer} row {t.row} (gap {t.gap:.1e})" for t in flipped)
        result.near_ties.append(f"{request}: agrees with k3 when its router takes the runner-up at {ties}")
    for got, want, p in zip(returned, expected, positions, strict=True):
        if math.isnan(got.logprob):
            result.unscored += 1
            continue
        want = _outcome(want, flipped)
        result.positions += 1
        d, agree = _distance(got, want, threshold)
        engine_best = max(got.top, key=got.top.get) if got.top else got.token
        result.top1_agree += agree
        result.max_dlogprob = max(result.max_dlogprob, d)
        if (d > threshold or not agree) and result.parting is None:
            result.parting = Parting(request, p, text(engine_best), text(want.top_ids[0]), d)
            result.fail(f"{request}: parts at position {p} (|dlogprob| {d:.3g}, threshold {threshold:g})")


def table(results: list[ScenarioResult]) -> str:
    """A plain terminal table, one line per scenario."""
    head = (
        f"{'scenario':<12} {'result':<7} {'req':>4} {'pos':>5} {'max|dlogp|':>11} {'top-1':>7}  first parting"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        verdict = "skip" if r.skipped else ("pass" if r.passed else "FAIL")
        where = (
            "" if r.parting is None else f"{r.parting.request} @ {r.parting.position}: {_shown(r.parting)}"
        )
        if r.skipped:
            where = r.skipped
        elif not where and not r.passed:
            where = r.notes[0]
        elif not where and r.near_ties:
            where = f"{len(r.near_ties)} request(s) agree with k3 at another outcome of a router near-tie"
        lines.append(
            f"{r.name:<12} {verdict:<7} {r.requests:>4} {r.positions:>5} {r.max_dlogprob:>11.3g} "
            f"{r.top1:>7.1%}  {where}"
        )
    return "\n".join(lines)


def _shown(p: Parting) -> str:
    return f"engine {p.engine_token!r} / k3 {p.k3_token!r} (|dlogprob| {p.dlogprob:.3g})"


def markdown(results: list[ScenarioResult], engine: str, threshold: float) -> str:
    lines = [
        f"# k3 conform: {engine}",
        "",
        f"Threshold: max |dlogprob| {threshold:g} over the shared top-k.",
        "",
        "| scenario | result | requests | positions | max \\|dlogprob\\| | top-1 | first parting |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        verdict = "skipped" if r.skipped else ("pass" if r.passed else "**FAIL**")
        where = r.skipped or (
            "" if r.parting is None else f"{r.parting.request} @ {r.parting.position}: {_shown(r.parting)}"
        )
        where = where.replace("|", "\\|")
        lines.append(
            f"| {r.name} | {verdict} | {r.requests} | {r.positions} | {r.max_dlogprob:.3g} | {r.top1:.1%} | "
            f"{where} |"
        )
    notes = [f"- {r.name}: {n}" for r in results for n in r.notes]
    notes += [f"- {r.name} (router near-tie): {n}" for r in results for n in r.near_ties]
    notes += [
        f"- {r.name}: {r.unscored} generated token(s) came without a logprob (not scored)"
        for r in results
        if r.unscored
    ]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def as_json(results: list[ScenarioResult], engine: str, threshold: float) -> str:
    payload = {
        "engine": engine,
        "threshold": threshold,
        "passed": all(r.passed for r in results),
        "scenarios": [r.to_json() for r in results],
    }
    return json.dumps(payload, indent=2)
