"""A table of tracked runs: held-out pass@1 at the start and end, its gain, and training averages, with seed
means and 95% t-intervals — for ablations that have no figure of their own.

    python -m analysis.summary --scale cpu --runs gspo,grpo_r2,grpo [--layer experiments/ablations/x.yaml]
                               [--seeds 1,2,3] [key=value ...]

Runs are `experiments/<scale>/base.yaml` + `experiments/runs/<run>.yaml` (+ each `--layer` file) + `seed=<s>`
+ overrides, found in MLflow by their `run_key` like every figure's runs; missing ones are listed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.aggregate import mean_ci
from analysis.rules import final_pass, gain, training_mean
from analysis.runs import PASS1, REWARD, load
from gspo_study.config import ConfigError, load_config
from gspo_study.run import run_key
from gspo_study.study import EXPERIMENTS, parse_seeds, scale_base

AVERAGED = {"routing volatility": "moe/routing_volatility/overall", "clip fraction": "policy/clip_frac/token"}


def _ci(values) -> str:
    mean, lo, hi, n = mean_ci(values)
    return f"{mean:.4f}" + ("" if lo != lo else f" [{lo:.4f}, {hi:.4f}]") + f" (n={n})"


def summary(scale: str, runs: list[str], seeds: list[int], layers=(), overrides=()) -> str:
    pairs = []
    for run in runs:
        files = [scale_base(scale), EXPERIMENTS / "runs" / f"{run}.yaml", *map(Path, layers)]
        pairs += [(run, load_config(files, [f"seed={s}", *overrides])) for s in seeds]
    first: dict[str, str] = {}
    for run, cfg in pairs:  # a layer that sets what the run file sets makes two run names one run
        key = run_key(cfg)
        if first.setdefault(key, run) != run:
            raise ConfigError(
                f"runs '{first[key]}' and '{run}' are the same run once {', '.join(layers) or 'the overrides'} "
                f"is layered on (run_key {key}); allowed: runs that stay distinct"
            )
    study = load(pairs)
    lines = [f"runs: {', '.join(runs)}; layers: {', '.join(layers) or '-'}; seeds: {seeds}", ""]
    lines += [
        "| run | pass@1 start | pass@1 end | gain | reward, last 10 steps | " + " | ".join(AVERAGED) + " |",
        "|---" * (5 + len(AVERAGED)) + "|",
    ]
    for run in study.names():
        start = study.values(PASS1, run).query("step == 0").groupby("seed").value.first()
        r = study.values(REWARD, run)
        last = r[r.step > r.step.max() - 10].groupby("seed").value.mean()
        avg = [_ci(training_mean(m)(study, run)) for m in AVERAGED.values()]
        lines.append(
            f"| {run} | {_ci(start)} | {_ci(final_pass(study, run))} | {_ci(gain(study, run))} | {_ci(last)} | "
            + " | ".join(avg)
            + " |"
        )
    for run, seed, why in study.missing:
        lines.append(f"missing: {run} seed {seed} ({why})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--scale", default="cpu")
    p.add_argument("--runs", required=True, help="run files, comma-separated (experiments/runs/<run>.yaml)")
    p.add_argument("--layer", action="append", default=[], help="extra YAML layered on every run")
    p.add_argument("--seeds", help="e.g. 1,2,3 (default: the scale's default seeds)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides for every run")
    args = p.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds, args.scale)
        print(summary(args.scale, args.runs.split(","), seeds, args.layer, args.overrides))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
