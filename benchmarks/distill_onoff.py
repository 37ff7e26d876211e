"""On-policy vs off-policy distillation at equal teacher tokens (rounds 4-6 of benchmarks/distill.py's
runs): every pairing of an on-policy run with the off-policy run it is compared to, counted evaluation by
evaluation (the runs draw the same prompts, so their teacher tokens agree at each shared evaluation, or
are interpolated where answer lengths differ).

Settings (run folders under OUT, written by benchmarks/distill.py):
- the four domains from the base (OUT/RUN[-sN]): off-policy SFT, supervised KD (`kd`: the forward KL to
  the teacher's whole distribution at its own samples) and on-policy forward KL (`forward-cold`);
- plain arithmetic alone (OUT/wc), the student a base fine-tuned with a planted carry error (`k3 rl sft
  --wrong-carry 0.6`, 70 % right), its teacher that base + 300 correct SFT steps; lr 1e-3 (1e-2 wrecks
  a 70 % student at once: 0.15 at iteration 10, both methods);
- arithmetic@long alone (`--tasks arithmetic@long`), the plain specialist as teacher (OUT/along-plain) or
  a teacher fine-tuned to continue right after a wrong scratchpad digit (OUT/along-robust, `k3 rl sft`
  with pad_noise): off-policy, on-policy forward KL from the base, and forward / reverse KL branching from
  the off-policy run at `--warm-start`;
- arithmetic@fix alone (OUT/fix, `--tasks arithmetic@fix --robust`), where a `<` takes back a digit, the
  teacher fine-tuned to take back wrong digits: off-policy, forward KL from the base, and forward KL /
  the sampled-token reverse KL (`sampled`, the issue's loss) branching at 60. Its on-policy answers are
  longer (the erasures), so its evaluations are paired by teacher tokens (`paired`), and its sampled
  (T = 1) accuracy is compared too;
- the four domains with arithmetic@fix in place of arithmetic@long (OUT/four-fix, `--tasks
  arithmetic@no,arithmetic@fix,sort,recall --robust`): off-policy and forward KL branching at 60;
- arithmetic-either alone (OUT/either, `--tasks arithmetic-either --iterations 400 --warm-start 150`): the
  sum written either way, one easy and one hard, its teacher 100 % on both, 50/50: off-policy, the
  sampled-token reverse KL per token (`sampled`) and over the rest of the sample (`sampled-seq`,
  `--kl-discount 1`), the full-vocabulary reverse KL per token (`reverse`) and over the rest of the sample
  (`reverse-seq`; with the leave-one-out baseline `reverse-seq-b`; length-normalized too, `reverse-seq-bn`),
  and the forward KL, branching at 150;
- arithmetic-either branching where `rule_branch` says (fixed before the fresh seeds ran; each run's log
  is checked to have branched there): seeds 0-11 (OUT/either-rule: `reverse-seq-b`, `reverse-seq-bn`),
  the fresh seeds 12-19 (OUT/either-fresh: `reverse-seq-bn`), and three domains (OUT/three: `--tasks
  arithmetic-either,sort,recall`, the rule on arithmetic-either's accuracy).

    PYTHONPATH=. python benchmarks/distill_onoff.py --out runs/distill-exp   # after the runs

Writes benchmarks/results/distill_onoff.csv (per pairing: evaluations where the on-policy run is ahead by
more than `--level` points, level, behind; the largest gaps; the mean difference), distill_onoff_log_*.csv
(the runs' logs) and distill_onoff.png (greedy accuracy; the fix and either panels also that task's at T = 1,
dashed).
"""

from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
FOUR = "four domains, from the base"
ROBUST = "arithmetic@long, teacher recovers (pad_noise)"
WRONG = "plain arithmetic, student with a planted carry error (lr 1e-3)"
PLAIN = "arithmetic@long, plain teacher"
FIX = "arithmetic@fix, teacher takes back wrong digits (pad_noise)"
FOUR_FIX = "four domains with arithmetic@fix (its teacher takes back wrong digits)"
EITHER = "arithmetic-either (two ways, one hard), branch at 150"
RULE = "arithmetic-either, branch by a rule fixed in advance (rule_branch)"
FRESH = "arithmetic-either, branch by the rule, fresh seeds 12-19 (loss fixed in advance)"
THREE = "three domains (arithmetic-either, sort, recall), branch by the rule on arithmetic-either"
EITHER_RUNS = "sampled-seq sampled forward reverse reverse-seq reverse-seq-b reverse-seq-bn".split()
# settings whose on-policy answers are longer (erasures): paired by teacher tokens (`paired`)
BY_TOKENS = {FIX, FOUR_FIX}
# (setting, folder under OUT, on-policy run, the run it is compared to, evaluations after this iteration, or
# the accuracy column whose rule_branch gives it per seed); each for every seed whose two runs exist (RUN
# for seed 0, RUN-sN)
PAIRS = [
    (FOUR, ".", "forward-cold", "off-policy", 0),
    (FOUR, ".", "kd", "off-policy", 0),
    (FOUR, ".", "forward-cold", "kd", 0),
    (WRONG, "wc", "forward-cold", "off-policy", 0),
    *[
        (setting, folder, on, off, branch)
        for setting, folder in ((PLAIN, "along-plain"), (ROBUST, "along-robust"))
        for on, off, branch in (
            ("forward-cold", "off-policy", 0),
            ("kd", "off-policy", 0),
            ("forward-cold", "kd", 0),
            ("forward", "off-policy", 60),
            ("reverse", "off-policy", 60),
        )
    ],
    (FIX, "fix", "forward-cold", "off-policy", 0),
    (FIX, "fix", "forward", "off-policy", 60),
    (FIX, "fix", "sampled", "off-policy", 60),
    (FOUR_FIX, "four-fix", "forward", "off-policy", 60),
    *[(EITHER, "either", on, "off-policy", 150) for on in EITHER_RUNS],
    *[(RULE, "either-rule", on, "off-policy", "acc_mean") for on in ("reverse-seq-b", "reverse-seq-bn")],
    (FRESH, "either-fresh", "reverse-seq-bn", "off-policy", "acc_mean"),
    (THREE, "three", "reverse-seq-bn", "off-policy", "acc_arithmetic-either"),
]
SEEDS = range(20)


def branched_at(on: dict[int, dict], after: int | None) -> bool:
    """Whether the on-policy run's own log shows its branch at `after`: no student token scored by then,
    some by its next evaluation."""
    if after not in on:
        return False
    later = [s for s in on if s > after]
    return on[after]["student_tokens"] == "0" and bool(later) and on[min(later)]["student_tokens"] != "0"


def rule_branch(off: dict[int, dict], col: str = "acc_mean") -> int | None:
    """The branching rule written down before the fresh seeds ran (rounds 5 and 6): the first evaluation at
    or after iteration 150 where the off-policy run's greedy accuracy `col` is >= 0.14 (None: never, before
    the last evaluation)."""
    last = max(off)
    return next((s for s in sorted(off) if 150 <= s < last and float(off[s][col]) >= 0.14), None)


def folder_of(out: Path, folder: str, run: str, seed: int) -> Path:
    return out / folder / (run + (f"-s{seed}" if seed else ""))


def evals(run: Path) -> dict[int, dict]:
    with (run / "log.csv").open(newline="") as f:
        return {int(r["step"]): r for r in csv.DictReader(f) if r["acc_mean"]}


def _mean(logs: list[dict[int, dict]]) -> dict[int, dict]:
    """The logs' mean accuracy and teacher tokens at each evaluation they all have."""
    steps = set.intersection(*(set(log) for log in logs))
    return {
        s: {
            k: str(sum(float(log[s][k]) for log in logs) / len(logs))
            for k in logs[0][s]
            if k[:4] in ("acc_", "teac", "samp") and all(log[s][k] for log in logs)
        }
        for s in sorted(steps)
    }


def at_tokens(log: dict[int, dict], tokens: float, col: str) -> float | None:
    """`col` of `log` linearly interpolated at `tokens` teacher tokens between the two evaluations around
    it (None: outside the log's range)."""
    points = sorted((float(r["teacher_tokens"]), float(r[col])) for r in log.values())
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= tokens <= x1:
            return y0 + (y1 - y0) * (tokens - x0) / max(1.0, x1 - x0)
    return None


def paired(on: dict[int, dict], off: dict[int, dict], after: int, col: str, by_tokens: bool):
    """(iteration, on-policy value, off-policy value) after `after`: at the same iteration, or with
    `by_tokens` the off-policy run's value interpolated at the on-policy evaluation's teacher tokens (for
    runs whose answers differ in length, so that the same iteration is not the same budget)."""
    out = []
    for s in sorted(s for s in on if s > after):
        if by_tokens:
            v = at_tokens({k: r for k, r in off.items() if k >= after}, float(on[s]["teacher_tokens"]), col)
        else:
            v = float(off[s][col]) if s in off else None
        if v is not None:
            out.append((s, float(on[s][col]), v))
    return out


def compare(
    on: dict[int, dict],
    off: dict[int, dict],
    after: int,
    level: float,
    ceiling: float,
    col: str = "acc_mean",
    by_tokens: bool = False,
) -> dict | None:
    """Counts of the paired evaluations after `after` (`paired`) where `on` is ahead of / level with /
    behind `off` (held-out accuracy `col`, in points; level: within `level`), over all of them and over
    those before both reach `ceiling` (`open_*`: where there is still something to learn)."""
    matched = paired(on, off, after, col, by_tokens)
    if not matched:
        return None
    diffs = [100 * (x - y) for _, x, y in matched]
    spread = max(
        abs(float(on[s]["teacher_tokens"]) / max(1.0, float(off[s]["teacher_tokens"])) - 1)
        for s, _, _ in matched
        if s in off
    )
    open_ = [d for d, (_, x, y) in zip(diffs, matched, strict=True) if max(x, y) < ceiling]
    return {
        "evaluations": len(matched),
        "ahead": sum(d > level for d in diffs),
        "level": sum(abs(d) <= level for d in diffs),
        "behind": sum(d < -level for d in diffs),
        "open": len(open_),  # evaluations before both reach `ceiling`
        "open_ahead": sum(d > level for d in open_),
        "open_level": sum(abs(d) <= level for d in open_),
        "open_behind": sum(d < -level for d in open_),
        "open_mean_difference": f"{sum(open_) / len(open_):.2f}" if open_ else "",
        "most_ahead": f"{max(diffs):.2f}",
        "most_behind": f"{min(diffs):.2f}",
        "mean_difference": f"{sum(diffs) / len(diffs):.2f}",
        "final_on": f"{matched[-1][1]:.6f}",
        "final_off": f"{matched[-1][2]:.6f}",
        "teacher_tokens_spread": f"{spread:.4f}",  # at the same iteration (by_tokens: before pairing)
        "diffs": " ".join(f"{d:+.1f}" for d in diffs),
    }


def plot(out: Path, png: Path) -> None:
    """Mean held-out accuracy against teacher tokens per setting (each seed thin, their mean bold); the
    probe's figures for arithmetic@long (benchmarks/distill_probe.py's csv) beside them."""
    from k3.train.plot import _pyplot

    plt = _pyplot()
    panels = [
        (FOUR, "."), (PLAIN, "along-plain"), (ROBUST, "along-robust"), (WRONG, "wc"), (FIX, "fix"),
        (FOUR_FIX, "four-fix"), (EITHER, "either"), (RULE, "either-rule"), (FRESH, "either-fresh"),
        (THREE, "three"),
    ]  # fmt: skip
    fig, axes = plt.subplots(3, 4, figsize=(30, 17))
    axes = axes.flatten()
    styles = {"off-policy": "C0", "kd": "C2", "forward-cold": "C3", "forward": "C1", "reverse": "C4",
              "sampled": "C5", "sampled-seq": "C6", "reverse-seq": "C8", "reverse-seq-b": "C9",
              "reverse-seq-bn": "k"}  # fmt: skip
    for ax, (title, folder) in zip(axes, panels, strict=False):
        for run, color in styles.items():
            if folder == "." and run not in ("off-policy", "kd", "forward-cold"):  # the rest: distill.png
                continue
            logs = [
                evals(f) for f in (folder_of(out, folder, run, s) for s in SEEDS) if (f / "log.csv").is_file()
            ]
            for log in logs:
                xs, ys = (
                    [float(r["teacher_tokens"]) for r in log.values()],
                    [float(r["acc_mean"]) for r in log.values()],
                )
                ax.plot(xs, ys, color=color, lw=0.6, alpha=0.35)
            if logs:
                mean = _mean(logs)
                xs, ys = (
                    [float(r["teacher_tokens"]) for r in mean.values()],
                    [float(r["acc_mean"]) for r in mean.values()],
                )
                ax.plot(
                    xs,
                    ys,
                    color=color,
                    lw=2,
                    marker="o",
                    ms=3,
                    label=f"{run} (mean of {len(logs)} seed{'s' * (len(logs) > 1)})",
                )
                col = {"fix": "sampled_acc_arithmetic@fix", "four-fix": "sampled_acc_arithmetic@fix",
                       "either": "sampled_acc_arithmetic-either",
                       "either-rule": "sampled_acc_arithmetic-either",
                       "either-fresh": "sampled_acc_arithmetic-either",
                       "three": "sampled_acc_arithmetic-either"}.get(folder)  # fmt: skip
                if col and all(col in r for r in mean.values()):
                    ax.plot(xs, [float(r[col]) for r in mean.values()], color=color, lw=1.5, ls="--",
                            label=f"{run}: {col.removeprefix('sampled_acc_')} at T = 1")  # fmt: skip
        ax.set(title=title, xlabel="teacher tokens", ylabel="mean held-out accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    probe = RESULTS / "distill_probe.csv"
    ax = axes[10]
    axes[11].axis("off")
    if probe.is_file():
        with probe.open(newline="") as f:
            rows = [
                r for r in csv.DictReader(f) if r["domain"] == "arithmetic@long" and r["setting"] != "four"
            ]
        labels = [f"{r['setting']}\n{r['run']} it.{r['iteration']}" for r in rows]
        x = range(len(rows))
        for k, (col, color) in enumerate(
            (("recover_pad", "C7"), ("self_recover_pad", "C3"), ("consistent", "C0"))
        ):
            ax.bar(
                [i + 0.27 * (k - 1) for i in x],
                [float(r[col] or 0) for r in rows],
                0.27,
                color=color,
                label=col,
            )
        ax.set_xticks(list(x), labels, fontsize=6, rotation=60, ha="right")
        ax.set(
            title="arithmetic@long: the student's T = 1 samples (benchmarks/distill_probe.py)", ylabel="share"
        )
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _rows(setting: str, on: str, off: str, seed, after: int, a: dict, b: dict, args) -> list[dict]:
    """The pairing's row on the mean accuracy, with several domains one per domain, and one per domain's
    sampled accuracy where both runs logged it (`sampled_acc_<task>`: k3 distill's T = 1 accuracy)."""
    first = (next(iter(a.values())), next(iter(b.values())))
    columns = [k for k in first[0] if k.startswith("acc_")]
    sampled = [k for k in first[0] if k.startswith("sampled_acc_") and all(r.get(k) for r in first)]
    greedy = ["acc_mean", *[c for c in columns if c != "acc_mean"]] if len(columns) > 2 else ["acc_mean"]
    out = []
    for col in greedy + sampled:
        row = {"setting": setting, "on_policy": on, "off_policy": off, "seed": seed, "after_iteration": after}
        counted = compare(a, b, after, args.level, args.ceiling, col, setting in BY_TOKENS)
        if counted is not None:
            out.append({**row, "accuracy": col.removeprefix("acc_"), **counted})
            print({k: out[-1][k] for k in list(out[-1])[:16]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/distill-exp")
    ap.add_argument("--level", type=float, default=2.0, help="points within which two runs are level")
    ap.add_argument("--ceiling", type=float, default=0.98, help="open evaluations: both runs below it")
    args = ap.parse_args()
    out, rows = Path(args.out), []
    for setting, folder, on, off, branch in PAIRS:
        pooled: list[tuple[dict, dict]] = []
        branches = []
        for seed in SEEDS:
            a, b = folder_of(out, folder, on, seed), folder_of(out, folder, off, seed)
            if (a / "log.csv").is_file() and (b / "log.csv").is_file():
                pooled.append((evals(a), evals(b)))
                if isinstance(branch, str):  # the accuracy column of the branching rule
                    after = rule_branch(pooled[-1][1], branch)
                    if not branched_at(pooled[-1][0], after):
                        raise SystemExit(f"{a}: did not branch where the rule says ({after})")
                else:
                    after = branch
                branches.append(after)
                rows += _rows(setting, on, off, seed, after, *pooled[-1], args)
                for run in (a, b) if folder != "." or seed else ():  # (seed 0's: distill.py's table)
                    name = f"distill_onoff_{folder.replace('along-', '').strip('.') or 'four'}_{run.name}"
                    shutil.copy(run / "log.csv", RESULTS / f"{name.replace('-', '_')}_log.csv")
        if len(pooled) > 1:  # the seeds' mean at each evaluation they all share
            per_seed = {r["accuracy"]: [] for r in rows[-1:]}
            for r in rows:
                if (r["setting"], r["on_policy"], r["off_policy"]) == (setting, on, off) and r["open"]:
                    per_seed.setdefault(r["accuracy"], []).append(float(r["open_mean_difference"]))
            means = [_mean([p[k] for p in pooled]) for k in (0, 1)]  # (per-seed branches: after the latest)
            pooled_rows = _rows(setting, on, off, "mean", max(branches), *means, args)
            for r in pooled_rows:  # the seeds' own open mean differences: their mean and standard error
                d = per_seed.get(r["accuracy"], [])
                if len(d) > 1:
                    m = sum(d) / len(d)
                    se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
                    r.update(seeds=len(d), seed_mean_difference=f"{m:.2f}", seed_standard_error=f"{se:.2f}")
            rows += pooled_rows
    with (RESULTS / "distill_onoff.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    plot(out, RESULTS / "distill_onoff.png")


if __name__ == "__main__":
    main()
