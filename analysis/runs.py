"""Tracked MLflow runs → one long pandas frame (the analysis's input).

- Runs are found only in MLflow: the run of a config is the one tagged `run_key = run.run_key(cfg)` in
  experiment `cfg.tracking.experiment` at `run.tracking_uri(cfg)`; only FINISHED runs count.
- The long frame has one row per (run, seed, step, metric): columns run, label, seed, run_id, step, metric,
  value, flops. `flops` is the run's cumulative `compute/flops` at that step; step 0 (the cold-start
  evaluation, before any training) has none logged and is taken as 0.
- A comparison holds runs of one numerics version only (`check_numerics`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from gspo_study.config import Config, ConfigError
from gspo_study.run import run_key, tracking_uri
from gspo_study.tracking import checked_client, find_run, metric_name

REWARD, PASS1, FLOPS = "rollout/reward/mean", "eval/pass@1", "compute/flops"

# Readable series names, by run file (experiments/runs/<name>.yaml); other runs show their file name.
LABELS = {
    "gspo": "GSPO",
    "grpo_r2": "GRPO + R2",
    "grpo": "GRPO (no replay)",
    "grpo_r3": "GRPO + R3",
    "dppo": "DPPO",
    "grpo_r3_bf16": "GRPO + R3, bf16 rollout",
    "gspo_bf16_rollout": "GSPO, bf16 rollout log-probs",
    "gspo_bf16_recompute": "GSPO, bf16 rollout, recomputed π_old",
    "grpo_r2_bf16_rollout": "GRPO + R2, bf16 rollout log-probs",
    "grpo_r2_bf16_recompute": "GRPO + R2, bf16 rollout, recomputed π_old",
    "grpo_bf16_recompute": "GRPO (no replay), bf16 rollout, recomputed π_old",
    **{
        f"{run}_bf16_{c}": f"{name}, bf16 rollout, {what}"
        for run, name in (("gspo", "GSPO"), ("grpo_r2", "GRPO + R2"))
        for c, what in (("tis", "token TIS"), ("mis", "sequence MIS"), ("icepop", "IcePop"))
    },
}


def label(run: str) -> str:
    return LABELS.get(run, run.replace("_", " "))


class MissingRunError(ConfigError):
    """A run the analysis needs is not in the tracking store (or did not finish)."""


@dataclass
class TrackedRun:
    run: str  # run file name (experiments/runs/<run>.yaml)
    seed: int
    cfg: Config
    run_id: str
    tags: dict[str, str]
    numerics: int = 1  # the run's numerics version (its `numerics` param; runs from before the param: 1)


@dataclass
class Study:
    """The tracked runs of a figure (or a report) and their metric histories."""

    runs: list[TrackedRun]
    frame: pd.DataFrame
    uri: str
    experiment: str
    out_dir: Path
    x: str = "compute"
    missing: list[tuple[str, int, str]] = field(default_factory=list)  # (run, seed, why)

    def values(self, metric: str, run: str | None = None) -> pd.DataFrame:
        f = self.frame[self.frame.metric == metric]
        return f if run is None else f[f.run == run]

    def names(self) -> list[str]:
        return list(dict.fromkeys(r.run for r in self.runs))


# ------------------------------------------------------------------------------------------------ loading
def _find(client, cfg: Config):
    """The config's run in its experiment, or why there is none."""
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None, f"no experiment {cfg.tracking.experiment!r}"
    found = find_run(client, exp.experiment_id, run_key(cfg))
    if found is None:
        return None, "not trained"
    if found.info.status != "FINISHED":
        return None, f"status {found.info.status}"
    return found, ""


def _history(client, run, name: str, seed: int, rid: str) -> pd.DataFrame:
    rows = []
    for key in run.data.metrics:
        rows += [(m.step, metric_name(key), m.value) for m in client.get_metric_history(rid, key)]
    out = pd.DataFrame(rows, columns=["step", "metric", "value"])
    out.insert(0, "run_id", rid)
    out.insert(0, "seed", seed)
    out.insert(0, "label", label(name))
    out.insert(0, "run", name)
    flops = out[out.metric == FLOPS].set_index("step").value
    out["flops"] = out.step.map(flops).where(out.step != 0, 0.0)  # step 0 = cold start, no compute yet
    return out


def load(pairs: Iterable[tuple[str, Config]], x: str = "compute") -> Study:
    """Metric histories of every (run, config) found; the others are listed in `Study.missing`."""
    pairs = list(pairs)
    if not pairs:
        raise ConfigError("no runs to analyse")
    cfg0 = pairs[0][1]
    clients: dict[str, object] = {}
    runs, frames, missing = [], [], []
    for name, cfg in pairs:
        uri = tracking_uri(cfg)
        client = clients.setdefault(uri, checked_client(uri))
        run, why = _find(client, cfg)
        if run is None:
            missing.append((name, cfg.seed, why))
            continue
        numerics = int(run.data.params.get("numerics", 1))
        runs.append(TrackedRun(name, cfg.seed, cfg, run.info.run_id, dict(run.data.tags), numerics))
        frames.append(_history(client, run, name, cfg.seed, run.info.run_id))
    check_numerics(runs)
    columns = ["run", "label", "seed", "run_id", "step", "metric", "value", "flops"]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    return Study(runs, frame, tracking_uri(cfg0), cfg0.tracking.experiment, cfg0.out_dir, x, missing)


def check_numerics(runs: list[TrackedRun]) -> None:
    """A figure or report compares runs of one numerics version only (the `numerics` knob: kernels and reduction
    orders that move numbers): a one-line error naming the versions and a run of each otherwise."""
    by: dict[int, TrackedRun] = {}
    for r in runs:
        by.setdefault(r.numerics, r)
    if len(by) > 1:
        shown = "; ".join(f"numerics {v}: e.g. {r.run} seed {r.seed}" for v, r in sorted(by.items()))
        raise ConfigError(f"these runs mix numerics versions ({shown}); allowed: one version per comparison")
