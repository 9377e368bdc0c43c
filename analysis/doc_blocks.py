"""The numbers of the docs, written from the shipped study and the measurements, never typed in.

    python -m analysis.doc_blocks [--scale cpu] [--check]

Each document holds marked blocks, `<!-- BEGIN <name> -->` … `<!-- END <name> -->`; this script rewrites every
one from `results/<scale>/REPORT.json` (the report's estimates and verdicts, `make report`), the figure CSVs and
the shipped runs' own start and end times (`results/<scale>/study-runs.parquet`). The blocks of `MEASURED`
(docs/RELIABILITY.md, PERFORMANCE.md, SCALE.md, GPU.md) and README's test time come from their measurements'
JSON under results/ and the gpu scale's configs (benchmarks/). `make report` runs it at the CPU scale; `--check`
exits 1 and names the block when a document differs from what the results say (the test `tests/test_readme.py` does
the same, so a redraw that changes a number fails until the text follows)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pandas as pd

from analysis.registry import entries

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "FIGURES.md")
BLOCK = re.compile(r"(<!-- BEGIN (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- END (?P=name) -->)", re.S)

FIGURES = entries()  # each figure's lines: `what`, `short`, `claims`, `no_claim`, `frontier` (experiments/figures.yaml)


def _g(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}".replace("-", "−")


def _estimate(e: dict) -> str:
    """An estimate's number: "0 of 4 [0, 60 %]" for a count, else mean ±half-width."""
    if e.get("k") is not None:
        return e["value"]
    half = "" if e["half_width"] is None else f" ±{_g(e['half_width'], 2)}"
    return f"{_g(e['mean'])}{half}"


def _primary(r: dict) -> dict | None:
    return next((e for e in r["estimates"] if e["role"] == "primary"), None)


def _runs(r: dict) -> str:
    """Which runs a row is measured on, in a few words: "figure 11's 4-layer 300-step runs, 4 seeds"."""
    join = lambda xs: "/".join(map(str, xs))  # noqa: E731
    seeds = len(r["seeds"])
    return f"figure {r['figure']}'s {join(r['layers'])}-layer {join(r['steps'])}-step runs, {seeds} seeds"


def _claim(r: dict) -> str:
    """One report row in a few words: its primary measure, the runs, its number (mean ±half-width) and verdict."""
    e = _primary(r)
    if e is None:
        return f"row {r['claim']} ({r['primary_measure']}; {_runs(r)}): {r['glance']} → **{r['verdict']}**"
    return f"row {r['claim']} ({r['primary_measure']}; {_runs(r)}): {_estimate(e)} → **{r['verdict']}**" + _same(e)


def _same(e: dict) -> str:
    """A difference's equivalence reading in words a reader can repeat (beside the verdict, never instead of it)."""
    from analysis.rules import MARGIN

    return f", i.e. within {MARGIN} pass@1 of each other (both one-sided 95 % bounds)" if e.get("equivalent") else ""


def report_records(results: Path) -> dict[int, dict]:
    return {r["claim"]: r for r in json.loads((results / "REPORT.json").read_text())}


def _vector(flags: str) -> str:
    """The widest vector extension family a run's `provenance.cpu_flags` name."""
    names = flags.split()
    return "AVX-512-BF16" if "avx512_bf16" in names else "AVX-512" if "avx512f" in names else "AVX2"


def _machine(model: str, flags: str) -> str:
    """A run's CPU in a few words: its maker's line and its widest vector extension ("AMD EPYC, AVX-512-BF16")."""
    short = " ".join(w for w in model.replace("(R)", "").split() if w not in ("Processor", "CPU"))
    return f"{short}, {_vector(flags)}" if short else _vector(flags)


def wall_minutes(results: Path, scale: str) -> dict[int, tuple[int, float, str, str]]:
    """Per figure: its shipped runs, their median wall time (minutes, start to end as MLflow recorded it), the
    CPUs they were drawn on (`provenance.cpu`'s model and the vector extensions its `provenance.cpu_flags` name) and
    their numerics version(s) (the `numerics` param; runs from before it have none and are version 1)."""
    from gspo_study.run import run_key
    from gspo_study.study import figure_configs, figures, parse_seeds

    runs = pd.read_parquet(results / "study-runs.parquet")
    tags = runs.tags.map(dict)
    runs["key"] = tags.map(lambda t: t.get("run_key"))
    runs["cpu_flags"] = tags.map(lambda t: t.get("provenance.cpu_flags", ""))
    runs["cpu_model"] = tags.map(lambda t: t.get("provenance.cpu", ""))
    runs["minutes"] = (runs.end_time - runs.start_time) / 60_000
    runs["numerics"] = runs.params.map(lambda p: dict(p).get("numerics", "1"))
    out = {}
    for name in figures():
        n = int(name.removeprefix("figure-"))
        keys = {run_key(cfg) for _, cfg in figure_configs(n, scale, parse_seeds(None, scale, n))}
        mine = runs[runs.key.isin(keys)]
        if len(mine):
            cpu = " + ".join(sorted({_machine(m, f) for m, f in zip(mine.cpu_model, mine.cpu_flags)}))
            out[n] = (len(mine), float(mine.minutes.median()), cpu, ", ".join(sorted(set(mine.numerics))))
    return out


def _figure_1(results: Path, records: dict[int, dict], walls: dict) -> str:
    f = pd.read_csv(results / "figure-1.csv")
    p = f[(f.panel == "b") & (f.kind == "curve")]
    start, last = p.step.min(), p.step.max()
    at = {s: p[(p.series == s) & (p.step == last)].iloc[0] for s in ("GSPO", "GRPO + R2")}
    cold = p[p.step == start]["mean"].mean()  # every arm's step 0 is the same cold start
    runs, minutes, cpu, _ = walls[1]
    seeds = int(at["GSPO"].n_seeds)
    r = records[2]
    d = _primary(r)
    beside = "; ".join(f"{e['name']} {_estimate(e)} → {e['verdict']}" for e in r["estimates"] if e is not d)
    return (
        f"Figure 1 at the CPU scale ({seeds} seeds, {last} steps from a cold start at held-out pass@1 {_g(cold)}): "
        f"at step {last} GSPO reaches {_g(at['GSPO']['mean'])} [{_g(at['GSPO'].lower)}, {_g(at['GSPO'].upper)}] "
        f"and GRPO + R2 {_g(at['GRPO + R2']['mean'])} [{_g(at['GRPO + R2'].lower)}, {_g(at['GRPO + R2'].upper)}]. "
        f"REPORT.md row 2 is judged on its primary measure, {d['measure']}: Δ {_estimate(d)} (95 % half-width) → "
        f"**{r['verdict']}**" + (f"; beside it, not judged into it: {beside}" if beside else "") + ". "
        f"Its {runs} runs took {minutes:.0f} min each (median) on a 2-core CPU ({cpu}) at 1 thread, 2 at a time.\n"
    )


def _figure_4(results: Path) -> str:
    """Figure 4's own runs: routing volatility per step (after a step's minibatch updates), mean over training."""
    from analysis.figures import depth
    from gspo_study.study import run_config

    f = pd.read_csv(results / "figure-4.csv")
    b = f[(f.panel == "b") & (f.kind == "curve")]
    cfg = run_config("cpu", "gspo", 1)
    means = b.groupby("series", sort=False)["mean"].mean()
    shown = ", ".join(f"{s} {m:.2%}" for s, m in means.items())
    return (
        f"its own {depth(cfg)}-layer {cfg.train.steps}-step runs, routing volatility per step (after the step's "
        f"{cfg.train.num_minibatches} updates), mean over training: {shown}; no claim is judged on them (claim 5 is "
        "judged per update on figure 11's runs: row 5, in figure 11's line)"
    )


def _results_table(results: Path, records: dict[int, dict], walls: dict) -> str:
    lines = [
        "| figure | what it shows | result at the CPU scale: REPORT.md row (its primary measure; the runs), "
        "mean ±95 % half-width → verdict | runs, min each (CPU; numerics version) |",
        "|---|---|---|---|",
    ]
    for n, fig in FIGURES.items():
        shown = "; ".join(_claim(records[c]) for c in fig.claims if c in records)
        if n == 4:
            shown = _figure_4(results)
        if n == 11 and 13 in records:
            shown += f"; {_other_arms(records[13])}"
        if fig.frontier and (frontier := _frontier_records(results)):
            shown = _frontier_line(n, frontier)
        runs, minutes, cpu, numerics = walls.get(n, (0, float("nan"), "", ""))
        link = f"[{n}](results/cpu/figure-{n}.png)" if (results / f"figure-{n}.png").is_file() else str(n)
        wall = f"{runs}, {minutes:.0f} ({cpu}; numerics {numerics})" if runs else "– (no run yet)"
        lines.append(f"| {link} | {fig.what} | {shown or fig.no_claim} | {wall} |")
    return "\n".join(lines) + "\n"


def _results_lines(results: Path, records: dict[int, dict]) -> str:
    """The README's results: one line per figure, each REPORT row it carries as its number and verdict."""
    lines = ["| figure | what | REPORT.md rows at the CPU scale (mean ±95 % half-width → verdict) |", "|---|---|---|"]
    for n, fig in FIGURES.items():
        rows = [(c, _primary(records[c])) for c in fig.claims if c in records and _primary(records[c])]
        shown = "; ".join(f"row {c}: {_estimate(e)} → {records[c]['verdict']}{_same(e)}" for c, e in rows)
        shown = shown or fig.no_claim
        link = f"[{n}](results/cpu/figure-{n}.png)" if (results / f"figure-{n}.png").is_file() else str(n)
        lines.append(f"| {link} | {fig.short} | {shown} |")
    return "\n".join(lines) + "\n"


def _frontier_records(results: Path) -> dict:
    """REPORT.md's frontier section as records (results/<scale>/FRONTIER.json), {} before it is written."""
    path = results / "FRONTIER.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _frontier_line(figure: int, records: dict) -> str:
    """A frontier figure's line from REPORT.md's frontier section (FRONTIER.json): per axis and dose, each arm's
    collapsed count; for the decisive stage, each arm's paired Δ final pass@1 against GRPO without replay at the
    axis's decisive dose, with its half-width and reading."""
    from analysis.frontier import arms_of, load_plan
    from analysis.runs import label

    summ, comp, plan = records["summary"], records["comparisons"], load_plan()
    parts = []
    for axis in FIGURES[figure].frontier:
        rows = [r for r in summ if r["axis"] == axis]
        if figure == 15:  # at the axis's decisive dose (the plan's rule, recomputed by the REPORT)
            dose = (records.get("decisive_doses") or {}).get(axis)
            if dose is None:
                continue
            deltas = "; ".join(
                f"{label(c['arm'])} − GRPO {_g(c['delta'])} ±{_g((c['hi'] - c['lo']) / 2, 2)} (n={c['n']}) → "
                f"{c['reading']}"
                for c in comp
                if c["axis"] == axis and c["dose"] == dose
            )
            down = ", ".join(f"{label(r['arm'])} {r['collapsed']}/{r['runs']}" for r in rows if r["dose"] == dose)
            parts.append(f"axis {axis} at {dose:g}: collapsed {down}; Δ final pass@1 {deltas}")
            continue
        mine = arms_of(plan, axis)  # the pilot's arms of the axis, in the plan's order
        if figure == 16:  # the refinement's doses alone
            rows = [r for r in rows if r["dose"] in [float(d) for d in plan["refinement"]["doses"]]]
        rows = sorted((r for r in rows if r["arm"] in mine), key=lambda r: (r["dose"], mine.index(r["arm"])))
        if not rows:
            continue
        by_dose: dict[float, list[str]] = {}
        for r in rows:
            by_dose.setdefault(r["dose"], []).append(f"{r['collapsed']}/{r['runs']}")
        arms = " / ".join(label(a) for a in mine)
        what = {"positive": "positive control (lr)", "control": "control (head noise)"}.get(axis, f"axis {axis}")
        parts.append(f"{what}, collapsed ({arms}): " + "; ".join(f"{d:g}: {' '.join(v)}" for d, v in by_dose.items()))
    return "; ".join(parts) + " (REPORT.md's frontier section: every finished seed)" if parts else ""


def _other_arms(r: dict) -> str:
    """Row 13's other arms' counts (secondary, not judged), grouped by count."""
    counts: dict[str, list[str]] = {}
    for e in r["estimates"]:
        if e["role"] == "secondary" and e.get("k") is not None and "version" not in e["name"]:
            arm = (
                e["name"]
                .replace(", bf16 rollout", "")
                .replace(", recomputed π_old", "")
                .replace(", IcePop", " + IcePop")
            )
            counts.setdefault(e["value"], []).append(arm)
    return "; ".join(f"{', '.join(arms)} (not judged): {value} each" for value, arms in counts.items())


def _claims_list(records: dict[int, dict]) -> str:
    return "".join(
        f"{n}. {r['text']} — primary measure: {r['primary_measure']} (figure {r['figure']}) → **{r['verdict']}**\n"
        for n, r in sorted(records.items())
    )


def _rows(records: dict[int, dict], verdict: str) -> list[int]:
    return [n for n, r in sorted(records.items()) if r["verdict"] == verdict]


def _list(rows: list[int]) -> str:
    return ("row " if len(rows) == 1 else "rows ") + ", ".join(map(str, rows))


def _findings(records: dict[int, dict]) -> str:
    """What the study found, in four sentences, from REPORT.json: the verdicts, the measured reason (routing
    volatility per update against the paper's), the long-horizon comparison and collapse count it leads to, and
    what the underpowered rows would need."""
    from analysis.rules import COLLAPSE_RATE, MARGIN

    judged = [r for r in records.values() if r["verdict"] not in ("measured", "not run")]
    by = {v: _rows(records, v) for v in ("reproduces", "not reproduced", "underpowered", "inconclusive")}
    plural = {"reproduces": "reproduce"}
    counts = ", ".join(
        f"{len(rows)} {plural.get(v, v) if len(rows) > 1 else v} ({_list(rows)})" for v, rows in by.items() if rows
    )
    vol = [e for e in records[5]["estimates"] if e.get("paper") is not None]
    fold = sorted(e["paper"] / e["mean"] for e in vol)
    pct = sorted(100 * e["mean"] for e in vol)
    long, down = _primary(records[14]), _primary(records[13])
    wide = [_primary(records[n]) for n in by["underpowered"]]
    halves = sorted(e["half_width"] for e in wide if e and e["half_width"] is not None and "pass@1" in e["measure"])
    counted = [n for n in by["underpowered"] if _primary(records[n]) and _primary(records[n])["k"] is not None]
    also = f", and {_list(counted)}'s count" if counted else ""
    rate = f"{100 * COLLAPSE_RATE:.0f} %"
    return (
        f"Of the {len(records)} claims in REPORT.md, {len(judged)} carry a verdict: {counts}.\n"
        f"Routing moves ≈ {fold[0]:.0f}–{fold[-1]:.0f}× less per optimizer update than in the paper: "
        f"{pct[0]:.2f}–{pct[-1]:.2f} % of activated experts against ≈ {100 * vol[0]['paper']:.0f} % (row 5).\n"
        f"At that drift, GRPO without replay does not fall behind GRPO + R2 over {records[14]['steps'][0]} steps "
        f"(row 14: {_estimate(long)} → {records[14]['verdict']}{_same(long)}).\n"
        f"{'None' if down['k'] == 0 else down['k']} of its {down['n']} runs collapsed, a count that still allows a "
        f"rate up to {100 * down['upper']:.0f} % (row 13 → {records[13]['verdict']}).\n"
        f"The {len(by['underpowered'])} underpowered rows' half-widths ({_g(halves[0], 2)}–{_g(halves[-1], 2)} "
        f"pass@1{also}) exceed the gap they test for ({MARGIN} pass@1, a collapse rate of {rate}): they need more "
        "seeds.\n"
    )


def _frontier_finding(frontier: dict) -> str:
    """The routing frontier from FRONTIER.json, one short sentence per axis at its decisive dose: what the dose did,
    GRPO without replay's and the remedy's collapsed counts, the remedy's paired Δ final pass@1 and its reading
    ('' before the decisive doses exist)."""
    from analysis.runs import label

    doses = frontier.get("decisive_doses") or {}
    remedy = {"V": "grpo_r2", "M": "grpo_r3"}
    what = {"V": "Router lr ×{:g}", "M": "Rollout router noise σ {:g}"}
    said = []
    for axis, dose in doses.items():
        if dose is None or axis not in remedy:
            continue
        at = {r["arm"]: r for r in frontier["summary"] if r["axis"] == axis and r["dose"] == dose}
        comp = [c for c in frontier["comparisons"] if (c["axis"], c["dose"], c["arm"]) == (axis, dose, remedy[axis])]
        if "grpo" not in at or remedy[axis] not in at or not comp:
            continue
        base, arm, c = at["grpo"], at[remedy[axis]], comp[0]
        reached = (
            f"moved {_g(100 * base['drift_first'], 2)} % of routing choices in the first update"
            if axis == "V"
            else f"flipped {_g(100 * base['flips_per_layer'], 2)} % of routing choices per layer"
        )
        said.append(
            f"{what[axis].format(dose)} {reached}: GRPO without replay collapsed in {base['collapsed']} of "
            f"{base['runs']} runs, {label(remedy[axis])} in {arm['collapsed']} of {arm['runs']}, Δ final pass@1 "
            f"{_g(c['delta'])} ±{_g((c['hi'] - c['lo']) / 2, 2)} → {c['reading']}.\n"
        )
    return "".join(said)


def blocks(scale: str = "cpu") -> dict[str, str]:
    results = ROOT / "results" / scale
    records = report_records(results)
    walls = wall_minutes(results, scale)
    return {
        "figure-1": _figure_1(results, records, walls),
        "findings": _findings(records) + _frontier_finding(_frontier_records(results)),
        "results": _results_lines(results, records),
        "results-detail": _results_table(results, records, walls),
        "claims": _claims_list(records),
        "test-time": _test_time(),
    }


# ------------------------------------------------------------------------------------------------ measured blocks
# The blocks of the other documents, written from measurements and configs rather than from the study, by the same
# BEGIN/END mechanism (one way for a number to reach a doc): document → {block: writer}.
def _script(name: str):
    """benchmarks/<name>.py as a module (a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_time(results: Path = ROOT / "results") -> str:
    """`make test` in clean clones (results/test_times.json, written by benchmarks/test_times.py)."""
    t = json.loads((results / "test_times.json").read_text())
    tests = [c["tests_s"] / 60 for c in t["clean_clones"]]
    total = [c["total_s"] / 60 for c in t["clean_clones"] if c.get("total_s")]

    def span(minutes: list[float]) -> str:
        low, high = f"{min(minutes):.0f}", f"{max(minutes):.0f}"
        return low if low == high else f"{low}–{high}"

    clones = f"{len(tests)} clone{'s' if len(tests) > 1 else ''}"
    return (
        f"`make test` in a clean clone on a {t['machine']}: {span(total)} min with both environments built, of "
        f"which {span(tests)} min of tests ({clones}, {t['measured']}, docs/LOG.md); later runs take the tests alone.\n"
    )


def _bench_memory(results: Path = ROOT / "results") -> str:
    """docs/RELIABILITY.md: the memory estimate against measured peaks (results/bench_memory.json, `make bench`)."""
    return _script("bench_memory").table(json.loads((results / "bench_memory.json").read_text())) + "\n"


def _bench_vllm(results: Path = ROOT / "results") -> str:
    """docs/SCALE.md: the vLLM CPU engine's rollout speed against the HF engine's (results/bench_vllm.json)."""
    d = json.loads((results / "bench_vllm.json").read_text())
    cases = d["cases"]
    hf = cases.get("hf-float32", {}).get("tokens_per_s")
    speeds = ", ".join(
        f"{name} {c['tokens_per_s']:.0f}" + (f" ({c['tokens_per_s'] / hf:.2f}×)" if hf and name != "hf-float32" else "")
        for name, c in cases.items()
    )
    starts = [c["engine_import_s"] + c["engine_start_s"] for c in cases.values() if "engine_start_s" in c]
    start = f"; vLLM's import + engine start {min(starts):.0f}–{max(starts):.0f} s" if starts else ""
    load = d.get("load_average_before") or ["?"]
    return (
        f"Speed (`benchmarks/bench_vllm.py`, in `make bench`; `results/bench_vllm.json`): the bench batch "
        f"({d['batch']['prompts']} × {d['batch']['group']}, ≤ {d['batch']['max_new_tokens']} new tokens) on the "
        f"{d['model']} at {d['threads']} thread(s), {d['machine'].split(',')[0]} at load {load[0]}: response "
        f"tokens/s {speeds}{start}.\n"
    )


def _bench_targets(results: Path = ROOT / "results") -> str:
    """docs/PERFORMANCE.md: issue 50's targets as `make bench` last read them (results/bench_targets.json)."""
    targets = _script("targets")
    d = json.loads((results / "bench_targets.json").read_text())
    lines = ["| target | measured | bound | verdict |", "|---|---|---|---|"]
    for r in d["targets"]:
        v = "–" if r["value"] is None else f"{r['value']:.3g}"
        said = targets.VERDICT[r["met"]]
        said = f"**{said}**" if r["met"] is False else said
        lines.append(f"| {r['target']} | {v} | {targets.bound_text(r)} | {said} |")
    where = d["machine"].get("bench.json") or d["machine"]["this process"]
    return "\n".join(lines) + f"\n\nOn the {where.split(',')[0]}; `results/bench_targets.json` names its CPU flags.\n"


def _bench_ab(results: Path = ROOT / "results") -> str:
    """docs/PERFORMANCE.md: issue 50's before and after, one line per shape (results/bench_ab_<shape>.json,
    `python -m benchmarks.bench_ab`)."""
    lines = []
    for path in sorted(results.glob("bench_ab_*.json")):
        d = json.loads(path.read_text())
        c, s, n = d["config"], d["summary"], d["numbers"]
        pairs = ", ".join(f"{p['step_a_over_b']:.3f}" for p in s["pairs"])
        moved = ", ".join(f"`{k}/*`" for k in sorted({k.rsplit("/", 1)[0] for k in n["differ"]})) or "none"
        lines.append(
            f"- {c['shape']} shape (`{path.name}`, {c['machine'].split(',')[0]}): {c['after']} against {c['before']}, "
            f"{c['pairs']} pairs of {c['steps']} steps: {s['median_step_s']['A']:.2f} s per step against "
            f"{s['median_step_s']['B']:.2f} s, A/B {s['median_step_a_over_b']:.3f} (pairs {pairs}; whole process "
            f"{s['median_wall_a_over_b']:.3f}); {len(n['same'])} metric keys bit-equal at every step, "
            f"{len(n['differ'])} differ ({moved}), {len(n['unmatched'])} unmatched."
        )
    return "\n".join(lines) + "\n"


def _gpu_scale() -> str:
    """docs/GPU.md: per figure at the gpu scale, its runs, steps, estimated peak memory and time (its configs)."""
    gpu_scale = _script("gpu_scale")
    return gpu_scale.table(gpu_scale.rows()) + "\n"


def _gpu_model() -> str:
    """docs/GPU.md: the gpu scale's model, its sizes and its training state, from its preset."""
    gpu_scale = _script("gpu_scale")
    return gpu_scale.model_sizes() + "\n"


def _bench_trl(results: Path = ROOT / "results") -> str:
    """docs/PERFORMANCE.md: our RL step against TRL's (results/bench.json, `make bench`)."""
    b = json.loads((results / "bench.json").read_text())
    r, f = b["ratios"], b["floor"]
    ours = [f["runs"][k]["efficiency"] for k in ("ours-gspo", "ours-grpo-r2")]
    trl = [v["efficiency"] for k, v in f["runs"].items() if k.startswith("trl-")]
    need = [v["efficiency"] for v in f["at_2x"].values()]

    def pct(xs: list[float]) -> str:  # one value when the range's ends round alike ("17%", not "17–17%")
        lo, hi = f"{min(xs):.0%}", f"{max(xs):.0%}"
        return lo if lo == hi else f"{lo[:-1]}–{hi}"

    return (
        f"Tokens per second of an RL step against TRL's (`results/bench.json`, the machine at "
        f"{f['gemm_gflops']:.0f} GFLOP/s): GSPO {r['ours-gspo / trl-gspo']:.2f}× and GRPO + R2 "
        f"{r['ours-grpo-r2 / trl-grpo']:.2f}× with TRL on transformers' stock experts kernel; "
        f"{r['ours-gspo / trl-gspo@grouped_mm_index']:.2f}× and {r['ours-grpo-r2 / trl-grpo@grouped_mm_index']:.2f}× "
        f"with our `grouped_mm_index` kernel in TRL too. Routing replay costs "
        f"{b['parts']['replay']['r2_update_overhead_pct']:+.1f} % of the update. Our step runs at {pct(ours)} of the "
        f"machine's fp32 matmul rate at the model's shapes, TRL's at {pct(trl)}; 2× TRL would need {pct(need)}.\n"
    )


def _telemetry_subsample(results: Path = ROOT / "results") -> str:
    """docs/METRICS.md: the routing telemetry's cost and error by `telemetry.route_rows` (bench_telemetry.json)."""
    return _script("bench_telemetry").table(json.loads((results / "bench_telemetry.json").read_text()))


def _calibration(results: Path = ROOT / "results") -> str:
    """docs/FRONTIER.md: the routing frontier's calibration (results/cpu/calibration.csv, `make calibrate`)."""
    import pandas as pd

    from gspo_study.calibrate import table

    rows = pd.read_csv(results / "cpu" / "calibration.csv", dtype={"dose": str}).to_dict("records")
    return table(rows)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return "#" + text.replace(" ", "-")


def _log_index(root: Path = ROOT) -> str:
    """docs/LOG.md's index: one line per dated entry, newest first, its heading's outcome linked to the entry."""
    lines = []
    for heading in re.findall(r"^## (.+)$", (root / "docs" / "LOG.md").read_text(), re.M):
        when, _, what = heading.partition(" — ")
        lines.append(f"- [{when}]({github_anchor(heading)}){': ' + what if what else ''}")
    return "\n".join(reversed(lines)) + "\n"


MEASURED = {
    ROOT / "docs" / "FRONTIER.md": {"calibration": _calibration},
    ROOT / "docs" / "LOG.md": {"log-index": _log_index},
    ROOT / "docs" / "METRICS.md": {"telemetry-subsample": _telemetry_subsample},
    ROOT / "docs" / "RELIABILITY.md": {"bench-memory": _bench_memory},
    ROOT / "docs" / "PERFORMANCE.md": {"bench-trl": _bench_trl, "bench-targets": _bench_targets, "bench-ab": _bench_ab},
    ROOT / "docs" / "SCALE.md": {"bench-vllm": _bench_vllm},
    ROOT / "docs" / "GPU.md": {"gpu-model": _gpu_model, "gpu-scale": _gpu_scale},
}


def stale_measured() -> list[str]:
    """The documents of MEASURED whose blocks differ from what their writers say."""
    out = []
    for path, writers in MEASURED.items():
        text = path.read_text()
        if rewrite(text, {name: write() for name, write in writers.items()}) != text:
            out.append(str(path.relative_to(ROOT)))
    return out


def rewrite(text: str, found: dict[str, str]) -> str:
    """`text` with every marked block's body replaced by `found[name]` (a block this script does not write is an
    error: a typo would otherwise leave a hand-typed block unchecked)."""

    def body(m: re.Match) -> str:
        if m["name"] not in found:
            raise KeyError(f"unknown block {m['name']!r}; allowed: {', '.join(found)}")
        return m.group(1) + found[m["name"]] + m.group(4)

    return BLOCK.sub(body, text)


def stale(scale: str = "cpu", found: dict[str, str] | None = None) -> list[str]:
    """The documents whose blocks differ from what the results say (`found`: the blocks, if already written)."""
    found = blocks(scale) if found is None else found
    return [str(p.relative_to(ROOT)) for p in DOCS if rewrite(p.read_text(), found) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="cpu")
    p.add_argument("--check", action="store_true", help="only say which documents are stale (exit 1 if any)")
    args = p.parse_args(argv)
    if args.check:
        bad = stale(args.scale) + stale_measured()
        for path in bad:
            print(f"stale: {path} (rewrite it with python -m analysis.doc_blocks)")
        return 1 if bad else 0
    found = blocks(args.scale)
    for path in DOCS:
        path.write_text(rewrite(path.read_text(), found))
        print(path.relative_to(ROOT))
    for path, writers in MEASURED.items():
        path.write_text(rewrite(path.read_text(), {name: write() for name, write in writers.items()}))
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
