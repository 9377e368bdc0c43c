"""Calibration of the routing frontier's dials: what each dose does to routing, measured on a cold start before any
frontier run (`python -m gspo_study calibrate --scale cpu`, `make calibrate`).

- Axis M (the R3 paper's mechanism) and its control, forward-only: for each rollout-copy dose
  (`rollout.router_noise`, `rollout.router_precision`, `rollout.head_noise`), `batches` rollout batches of the
  frontier's base run, each against the trainer's π_old forward on it: the share of routing choices that differ
  per layer (`flips_per_layer`), the share of response tokens routed differently in ≥ 1 layer (`tokens_any`),
  k3 and F(τ = 2) — exactly the run's `moe/train_infer_routing/*` and `mismatch/*` metrics at step 1..batches.
- Axis V (the GSPO paper's mechanism): for each dial value (`train.router_lr_scale`, `train.num_minibatches`),
  `steps` RL steps of GRPO without replay from the cold start: the share of activated experts that change after
  one optimizer update (`per_update`, the paper's unit; `moe/routing_volatility/per_update/overall`) and after the
  step's updates (`per_step`).
- Axis F (the frozen router): axis V's readings with the routers frozen (`train.router_lr_scale=0`) at 4, 8 and 16
  minibatches: routing drift that comes only through the hidden states.
- Axis R (a routing change inside the ratio that only R2 removes): for each dose (`train.route_noise`, and the
  positive control `train.route_random`), `steps` RL steps of GRPO without replay with `telemetry.update_route`: the
  share of the objective's log-ratio variance that is routing (`route_share`, 1 − Σ Var ℓ^pol / Σ Var ℓ over the
  step's updates), the experts changed inside the ratio per update (`route_flips`; in the first, on-policy update
  alone: `route_flips_first`) and the routing-fixed part per update (`pol_var`, Var ℓ^pol), which the dose should
  leave at dose 0's level.

The frontier's base run is figure 13's fixed settings at the scale (its sweep keys with one value), run `grpo`,
seed 1, from that cold start. Writes results/<scale>/calibration.csv (one row per axis, dial, dose and measure:
mean over the batches or steps, its standard deviation and n), which docs and figure 13's panel (a) are drawn from.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from gspo_study.config import Config, coldstart_overrides
from gspo_study.study import ensure_coldstart, figure_spec, run_config

FRONTIER_FIGURE = 13  # its sweep's fixed settings are the frontier's base run
GRID: dict[str, dict[str, list]] = {
    "M": {
        "rollout.router_noise": [0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0],
        "rollout.router_precision": ["bfloat16", "float16", "float8_e4m3"],
    },
    "control": {"rollout.head_noise": [0.01, 0.03, 0.1, 0.3, 1.0, 1.25, 1.5]},
    "V": {
        "train.router_lr_scale": [1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0],
        "train.num_minibatches": [4, 8, 16],
    },
    "F": {"train.num_minibatches": [4, 8, 16]},  # with train.router_lr_scale=0 (`FIXED`)
    "R": {
        "train.route_noise": [0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0],
        "train.route_random": [True],
    },
}
FIXED = {"F": ("train.router_lr_scale=0",), "R": ("telemetry.update_route=true",)}  # what an axis always sets
PAPER = {  # the published levels each axis is dosed against (shared/PAPER.md, shared/COLLAPSE.md)
    "per_update": 0.10,  # GSPO paper §5.3: ≈ 10 % of activated experts change after one update (48 layers)
    "route_flips": 0.10,  # the same unit, inside the ratio
    "flips_per_layer": 0.057,  # R3 paper: 94 % of tokens differ in ≥ 1 of 48 layers, ≈ 5.7 % per layer
    "k3": 1.5e-3,  # R3 paper: train–inference k3 of Qwen3-30B-A3B without R3
}
COLUMNS = ["axis", "dial", "dose", "measure", "mean", "sd", "n"]


@dataclass(frozen=True)
class Reading:
    axis: str
    dial: str
    dose: object
    measure: str
    values: tuple[float, ...]

    def row(self) -> dict:
        v = self.values
        return dict(
            axis=self.axis,
            dial=self.dial,
            dose=self.dose,
            measure=self.measure,
            mean=statistics.fmean(v),
            sd=statistics.stdev(v) if len(v) > 1 else math.nan,
            n=len(v),
        )


def frontier_overrides(scale: str) -> tuple[str, ...]:
    """Figure 13's fixed settings at the scale (the sweep keys with a single value), as key=value overrides."""
    sweep = figure_spec(FRONTIER_FIGURE).get("sweep", {}).get(scale, {})
    return tuple(f"{k}={v[0]}" for k, v in sweep.items() if k != "cells" and isinstance(v, list) and len(v) == 1)


def base_config(scale: str, overrides: tuple[str, ...] = ()) -> Config:
    return run_config(scale, "grpo", 1, (*frontier_overrides(scale), *overrides))


def _context(cfg: Config, start: Path, overrides: tuple[str, ...]):
    from gspo_study.run import resolve_run
    from gspo_study.tracking import NullTracker
    from gspo_study.trainer import setup

    fixed = (*frontier_overrides(cfg.scale), *overrides, f"init_checkpoint={start}")
    cfg = run_config(cfg.scale, "grpo", cfg.seed, fixed)
    ctx = setup(resolve_run(cfg))
    ctx.tracker = NullTracker()
    return ctx


def mismatch_readings(cfg: Config, start: Path, axis: str, dial: str, dose, batches: int, extra=()) -> list[Reading]:
    """Axis M / control: the rollout copy against the trainer's π_old forward, on `batches` rollout batches."""
    from gspo_study.moe import mismatch_metrics, routing_volatility
    from gspo_study.trainer import old_policy, rollout

    ctx = _context(cfg, start, (*extra, f"{dial}={dose}"))
    got: dict[str, list[float]] = {k: [] for k in ("flips_per_layer", "tokens_any", "k3", "f_tau_2")}
    for step in range(1, batches + 1):
        _, batch = rollout(ctx, step)
        old = old_policy(ctx, batch)
        mask = batch.response_mask
        flips = routing_volatility(old.natural, batch.routing, mask)
        mm = mismatch_metrics(old.train_logprobs, batch.rollout_logprobs, mask)
        for key, value in (
            ("flips_per_layer", flips["overall"]),
            ("tokens_any", flips["tokens_any_changed"]),
            ("k3", mm["k3"]),
            ("f_tau_2", mm["f_tau_2"]),
        ):
            got[key].append(value)
    return [Reading(axis, dial, dose, k, tuple(v)) for k, v in got.items()]


def drift_readings(cfg: Config, start: Path, dial: str, dose, steps: int, extra=(), axis: str = "V") -> list[Reading]:
    """Axes V and F: GRPO without replay's routing drift per update and per step over its first `steps` RL steps."""
    from gspo_study.trainer import rl_step

    ctx = _context(cfg, start, (*extra, f"{dial}={dose}"))
    got: dict[str, list[float]] = {"per_update": [], "per_update_tokens_any": [], "per_step": []}
    for step in range(1, steps + 1):
        m = rl_step(ctx, step)
        got["per_update"].append(m["moe/routing_volatility/per_update/overall"])
        got["per_update_tokens_any"].append(m["moe/routing_volatility/per_update/tokens_any_changed"])
        got["per_step"].append(m["moe/routing_volatility/overall"])
    return [Reading(axis, dial, dose, k, tuple(v)) for k, v in got.items()]


def route_readings(cfg: Config, start: Path, dial: str, dose, steps: int, extra=()) -> list[Reading]:
    """Axis R: what the dose puts inside the objective's ratio over GRPO without replay's first `steps` RL steps."""
    from gspo_study.trainer import rl_step

    ctx = _context(cfg, start, (*extra, f"{dial}={dose}"))
    got: dict[str, list[float]] = {k: [] for k in ("route_share", "route_flips", "route_flips_first", "pol_var")}
    for step in range(1, steps + 1):
        m = rl_step(ctx, step)
        got["route_share"].append(m["moe/route_obj/r2_removed_share"])
        got["route_flips"].append(m["moe/route_obj/flips"])
        got["route_flips_first"].append(m["moe/route_obj/mb_0/flips"])
        got["pol_var"].append(m["moe/route_obj/pol_var"])
    return [Reading("R", dial, dose, k, tuple(v)) for k, v in got.items()]


def calibrate(
    scale: str, axes=("M", "control", "V"), batches: int = 4, steps: int = 4, overrides: tuple[str, ...] = ()
) -> list[dict]:
    """Every dose of `GRID` on the given axes; one row per (axis, dial, dose, measure)."""
    cfg = base_config(scale, overrides)
    start = ensure_coldstart(scale, (*overrides, *coldstart_overrides(cfg)))
    rows = []
    for axis in axes:
        for dial, doses in GRID[axis].items():
            for dose in doses:
                extra = (*FIXED.get(axis, ()), *overrides)
                if axis in ("V", "F"):
                    readings = drift_readings(cfg, start, dial, dose, steps, extra, axis)
                elif axis == "R":
                    readings = route_readings(cfg, start, dial, dose, steps, extra)
                else:
                    readings = mismatch_readings(cfg, start, axis, dial, dose, batches, overrides)
                rows.extend(r.row() for r in readings)
                shown = ", ".join(f"{r.measure} {statistics.fmean(r.values):.4g}" for r in readings)
                print(f"calibrate {axis} {dial}={dose}: {shown}", flush=True)
    return rows


def write(rows: list[dict], path: Path) -> Path:
    """The rows into `path`, keeping the rows it holds of every axis `rows` does not measure (one calibration file,
    its axes calibrated at different times)."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    new = pd.DataFrame(rows, columns=COLUMNS)
    if path.is_file():
        kept = pd.read_csv(path, dtype={"dose": str})
        new = pd.concat([kept[~kept.axis.isin(set(new.axis))], new.astype({"dose": str})])
    tmp = path.with_suffix(".tmp")
    new.to_csv(tmp, index=False)
    tmp.replace(path)
    return path


MEASURES = {  # the calibration's measures, in the words of the docs table (with the paper's level where known)
    "per_update": "experts changed per update",
    "per_update_tokens_any": "tokens changed in ≥ 1 layer, per update",
    "per_step": "experts changed per step",
    "flips_per_layer": "routing flips per layer",
    "tokens_any": "tokens routed differently in ≥ 1 layer",
    "k3": "k3",
    "f_tau_2": "F(τ = 2)",
    "route_share": "routing's share of Var ℓ inside the ratio (what R2 removes)",
    "route_flips": "experts changed per update, inside the ratio",
    "route_flips_first": "in the first (on-policy) update",
    "pol_var": "Var ℓ^pol per update (routing fixed)",
}


def table(rows: list[dict]) -> str:
    """The calibration as a markdown table: one row per dial and dose, one column per measure (mean ± its standard
    error over the batches or steps), the paper's level in the heading where it has one (docs/FRONTIER.md)."""
    by: dict[tuple, dict] = {}
    for r in rows:
        by.setdefault((r["axis"], r["dial"], str(r["dose"])), {})[r["measure"]] = r
    out = []
    for axis in GRID:
        keys = [k for k in by if k[0] == axis]
        measures = [m for m in MEASURES if any(m in by[k] for k in keys)]
        if not keys:
            continue
        head = [f"{MEASURES[m]} (paper: {PAPER[m]:g})" if m in PAPER else MEASURES[m] for m in measures]
        out += [f"| axis {axis}: dial = dose | " + " | ".join(head) + " |", "|---|" + "---:|" * len(measures)]
        for k in keys:
            cells = []
            for m in measures:
                r = by[k][m]
                se = r["sd"] / math.sqrt(r["n"]) if r["n"] > 1 and r["sd"] == r["sd"] else math.nan
                cells.append(f"{r['mean']:.3g}" + ("" if se != se else f" ± {se:.2g}"))
            out.append(f"| `{k[1]}={k[2]}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)
