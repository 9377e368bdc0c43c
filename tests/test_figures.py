"""Figures 1–7 and the report from tracked smoke runs (2 seeds): every figure's runs train once (shared runs
are not retrained), its png/pdf/csv are written under results/smoke and logged to MLflow, and every CSV row
equals what the test recomputes on its own from the MLflow metric histories."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient
from scipy import stats

from analysis import aggregate, figures, report
from gspo_study.config import ConfigError
from gspo_study.run import run_key
from gspo_study.study import figure_configs, run_config, run_figure
from gspo_study.tracking import mlflow_key

ROOT = Path(__file__).resolve().parents[1]
SEEDS = [1, 2]
PAPER_VALUES = {0.15, 0.0013, 0.10}
CLIP, VOL = "policy/clip_frac/token", "moe/routing_volatility"
REWARD, PASS1 = "rollout/reward/mean", "eval/pass@1"
# (kind, metric) every run of the figure must show; "mb_*" / "layer_*" expand to the run's minibatches / layers.
EXPECTED = {
    1: {("curve", REWARD), ("curve", PASS1)},
    2: {("bar", CLIP), ("bar", f"{CLIP}/mb_*")},
    3: {("curve", REWARD), ("curve", PASS1)},
    4: {("bar", f"{VOL}/layer_*"), ("curve", f"{VOL}/overall")},
    5: {(k, f"policy/ratio/{m}") for k in ("curve", "point") for m in ("token_var", "seq_var")},
    6: {("curve", m) for m in (REWARD, PASS1, "mismatch/k3", "mismatch/f_tau_2")},
    7: {("curve", m) for m in (REWARD, PASS1, "mismatch/k3")},
    11: {
        ("curve", m)
        for m in (
            REWARD,
            PASS1,
            "mismatch/k3",
            "train/grad_norm",
            "moe/route/r2_removed_share",
            "moe/train_infer_routing/tokens_any_changed",
        )
    },  # fmt: skip
}
EXPECTED[12] = EXPECTED[11]  # figure 11's panels at 8 minibatches per rollout batch


@pytest.fixture(scope="module")
def study(smoke_results, tmp_path_factory):
    """(results root, overrides) of a private study store; RL runs start from the session's cold start."""
    root = tmp_path_factory.mktemp("study")
    return root, (
        f"results_dir={root}",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"init_checkpoint={smoke_results}/smoke/checkpoints/coldstart",
    )


def tracked(client: MlflowClient) -> dict[str, list[tuple[str, int]]]:
    """run_key → [(run id, end time)] of every training run in the smoke experiment."""
    exp = client.get_experiment_by_name("study-smoke")
    out: dict[str, list] = {}
    for r in client.search_runs([exp.experiment_id]) if exp else []:
        if "run_key" in r.data.tags:
            out.setdefault(r.data.tags["run_key"], []).append((r.info.run_id, r.info.end_time))
    return out


def histories(client: MlflowClient, pairs) -> dict[tuple[str, int], dict[str, dict[int, float]]]:
    """(run name, seed) → metric → {step: value}, straight from MLflow."""
    exp = client.get_experiment_by_name("study-smoke")
    out = {}
    for name, cfg in pairs:
        run = client.search_runs([exp.experiment_id], f"tags.run_key = '{run_key(cfg)}'")[0]
        out[(name, cfg.seed)] = {
            k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in run.data.metrics
        }
    return out


def seed_stats(values: list[float]) -> tuple[float, float, float, int]:
    v = np.array(values, dtype=float)
    if len(v) < 2:
        return float(v.mean()), math.nan, math.nan, len(v)
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
    return float(v.mean()), float(v.mean() - half), float(v.mean() + half), len(v)


def expected(row, hist, seeds) -> tuple[float, float, float, float, int]:
    """(x, mean, lower, upper, n_seeds) of a CSV row, recomputed from the histories."""
    key = mlflow_key(row.metric)
    if row.kind == "reference":
        assert row.mean in PAPER_VALUES
        return row.x, row.mean, math.nan, math.nan, 0
    if row.kind == "point":
        h = hist[(row.run, int(row.seed))]
        step = int(row.step)
        return h[mlflow_key(row.x_name)][step], h[key][step], math.nan, math.nan, 1
    if row.kind == "bar":
        return (row.x, *seed_stats([np.mean(list(hist[(row.run, s)][key].values())) for s in seeds]))
    step = int(row.step)
    have = [s for s in seeds if step in hist[(row.run, s)][key]]
    flops = [0.0 if step == 0 else hist[(row.run, s)]["compute/flops"][step] for s in have]
    x = float(np.mean(flops)) if row.x_name == "compute/flops" else float(step)
    return (x, *seed_stats([hist[(row.run, s)][key][step] for s in have]))


def drawn_values(row, hist, seeds) -> tuple[float, float, float]:
    """(line, band_lower, band_upper) of a CSV row, recomputed: a curve's seeds each smoothed over the row's window
    of centered steps (the mean; the median for a heavy-tailed quantity; a pooled share as 1 − Σ num / Σ den), then
    over seeds the mean and t-interval cut to the quantity's range, or the median and seed range."""
    q = aggregate.quantity(row.metric)
    if row.kind in ("reference", "point"):
        return row.mean, math.nan, math.nan
    key = mlflow_key(row.metric)
    if row.kind == "bar":
        values = [np.mean(list(hist[(row.run, s)][key].values())) for s in seeds]
    else:
        logged = set().union(*(hist[(row.run, s)][key] for s in seeds))
        assert row.window == 2 * (len(logged) // 20) + 1  # about a tenth of the steps; 1 (none) under 20
        h, values = int(row.window) // 2, []
        for s in seeds:
            steps = sorted(hist[(row.run, s)][key])
            if row.step not in steps:
                continue
            i = steps.index(int(row.step))
            near = steps[max(0, i - h) : i + h + 1]
            if q.pooled:
                num, den = (sum(hist[(row.run, s)][mlflow_key(m)][t] for t in near) for m in q.pooled)
                values.append(1 - num / den if den else 0.0)
            else:
                values.append((np.median if q.stat == "range" else np.mean)([hist[(row.run, s)][key][t] for t in near]))
    if q.stat == "range":
        spread = (float(min(values)), float(max(values))) if len(values) > 1 else (math.nan, math.nan)
        return float(np.median(values)), *spread
    mean, lo, hi, _ = seed_stats(values)
    return mean, max(lo, q.low) if not math.isnan(lo) else lo, min(hi, q.high) if not math.isnan(hi) else hi


def close(a, b) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-9


def check_csv(csv: pd.DataFrame, figure: int, pairs, hist) -> None:
    for row in csv.itertuples():
        want = expected(row, hist, SEEDS)
        got = (row.x, row.mean, row.lower, row.upper, row.n_seeds)
        assert all(close(float(a), float(b)) for a, b in zip(got, want)), (row, want)
        want = drawn_values(row, hist, SEEDS)
        got = (row.line, row.band_lower, row.band_upper)
        assert all(close(float(a), float(b)) for a, b in zip(got, want)), (row, want)
    for metric, g in csv[csv.kind == "curve"].groupby("metric"):  # every logged step is drawn
        for run, rows in g.groupby("run"):
            logged = set().union(*(hist[(run, s)][mlflow_key(metric)] for s in SEEDS))
            assert sorted(rows.step.astype(int)) == sorted(logged), (run, metric)
    for name, cfg in pairs:
        drawn = {(r.kind, r.metric) for r in csv[csv.run == name].itertuples()}
        for kind, metric in EXPECTED[figure]:
            if metric.endswith("*"):  # every minibatch index / MoE layer the run logged
                metrics = {m for m in hist[(name, cfg.seed)] if m.startswith(metric[:-1])}
                assert metrics and {(kind, m) for m in metrics} <= drawn, (name, metric)
                assert "mb_" not in metric or len(metrics) == cfg.train.num_minibatches
            else:
                assert (kind, metric) in drawn, (name, kind, metric)


@pytest.mark.parametrize("figure", [f for f in sorted(figures.FIGURES) if f in EXPECTED])
def test_figure_from_tracked_runs(study, figure):
    """Figures 1–7 (figure 8, a sweep, has its own test below)."""
    root, overrides = study
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    before = tracked(client)
    cfgs = run_figure(figure, "smoke", SEEDS, overrides)
    after = tracked(client)
    keys = {run_key(c) for c in cfgs}
    assert set(after) - set(before) == keys - set(before)  # only the figure's missing runs were trained
    assert all(after[k] == v for k, v in before.items())  # runs of earlier figures were not touched
    assert all(len(v) == 1 for v in after.values())  # a shared run exists once

    paths = figures.make_figure(figure, "smoke", SEEDS, overrides)
    assert [p.name for p in paths] == [f"figure-{figure}.{e}" for e in ("png", "pdf", "csv")]
    assert all(p.parent == root / "smoke" and p.stat().st_size > 0 for p in paths)
    pairs = figure_configs(figure, "smoke", SEEDS, overrides)
    check_csv(pd.read_csv(paths[2]), figure, pairs, histories(client, pairs))

    exp = client.get_experiment_by_name("study-smoke")
    query = f"tags.figure = '{figure}' and tags.seeds = '1,2' and tags.x = 'compute'"
    fig_runs = client.search_runs([exp.experiment_id], query)
    assert len(fig_runs) == 1 and fig_runs[0].info.run_name == f"figure-{figure}"
    logged = {a.path for a in client.list_artifacts(fig_runs[0].info.run_id)}
    assert logged == {p.name for p in paths}


def test_steps_axis(study):
    root, overrides = study
    run_figure(3, "smoke", SEEDS, overrides)
    paths = figures.make_figure(3, "smoke", SEEDS, overrides, x="steps")
    csv = pd.read_csv(paths[2])
    curves = csv[csv.kind == "curve"]
    assert (curves.x_name == "step").all() and (curves.x == curves.step).all()
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    pairs = figure_configs(3, "smoke", SEEDS, overrides)
    check_csv(csv, 3, pairs, histories(client, pairs))


def test_missing_run_is_a_one_line_error(study, capsys, tmp_path):
    _, overrides = study
    # on a store that does not exist yet too: MLflow's table-creation lines (INFO, as on a fresh process) stay out
    for name in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    fresh = [f"results_dir={tmp_path / 'fresh'}"]
    assert figures.main(["--figure", "1", "--scale", "smoke", "--seeds", "9", *fresh]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gspo seed 9" in err, err
    # seed 1's runs finished (already, after test_figure_from_tracked_runs): --partial below draws from them
    run_figure(1, "smoke", [1], overrides)
    capsys.readouterr()
    assert figures.main(["--figure", "1", "--scale", "smoke", "--seeds", "9", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gspo seed 9" in err and "gspo_study sweep --figure 1" in err
    # --partial: still the error when no run of the figure is in; drawn from the finished runs when some are
    assert figures.main(["--figure", "1", "--scale", "smoke", "--seeds", "9", "--partial", *overrides]) == 2
    _, (_, *store) = study  # the figure's files go to a private root: the study root is checked for strays
    out = [f"results_dir={tmp_path}", *store]
    assert figures.main(["--figure", "1", "--scale", "smoke", "--seeds", "1,9", "--partial", *out]) == 0
    said = capsys.readouterr().out
    assert "drawn from 2 finished runs; 2 not yet trained" in said, said
    csv = pd.read_csv(tmp_path / "smoke" / "figure-1.csv")
    assert set(csv.n_seeds.dropna().astype(int)) == {1}


def test_report_one_row_per_claim(study):
    root, overrides = study
    run_figure(1, "smoke", SEEDS, overrides)
    run_figure(6, "smoke", SEEDS, overrides)  # claim 6 is measured on figure 6's runs
    path = report.make_report("smoke", SEEDS, overrides)
    assert path == root / "smoke" / "REPORT.md"
    text = path.read_text()
    rows = report.sections(text)
    table = [rows[n] for n in sorted(rows)]  # each row's first-table line and its details
    assert len(table) == len(report.CLAIMS) == len(re.findall(r"^### \d+\. ", text, re.M))
    assert "seeds: 1, 2" in text and "git commit(s) of the runs:" in text and "date:" in text
    verdicts = [report.verdict_of(row.splitlines()[0]) for row in table]
    allowed = {
        "reproduces",
        "not reproduced",
        "underpowered",
        "inconclusive",
        "consistent",
        "measured",
        "not run",
    }
    assert set(verdicts) <= allowed and verdicts[0] != "not run"
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    pairs = [(n, run_config("smoke", n, s, overrides)) for n in ("gspo",) for s in SEEDS]
    hist = histories(client, pairs)
    final = np.mean([h[mlflow_key(PASS1)][max(h[mlflow_key(PASS1)])] for h in hist.values()])
    assert f"GSPO {final:.4g}" in table[1]  # claim 2 (efficiency) quotes GSPO's final pass@1 over seeds
    start = np.mean([h[mlflow_key(PASS1)][0] for h in hist.values()])
    gains = [h[mlflow_key(PASS1)][max(h[mlflow_key(PASS1)])] - h[mlflow_key(PASS1)][0] for h in hist.values()]
    assert f"({start:.3g}): {np.mean(gains):.4g}" in table[0]  # claim 1: gain over the cold start
    for c, row in zip(report.CLAIMS, table):
        counts = re.search(r"(\d+) of (\d+) sweep runs", row)
        verdict = report.verdict_of(row.splitlines()[0])
        if c.figure == 6:  # measured on figure 6's runs, trained above
            assert counts and counts[1] == counts[2] and verdict != "not run", row
        elif c.figure is not None and c.figure != 11:  # the other sweeps were not trained here (11: by the figure test)
            assert verdict == "not run" if counts is None else int(counts[1]) < int(counts[2])


def test_report_without_any_run_stops_and_keeps_the_old_report(study, tmp_path):
    """A fresh clone has the committed REPORT.md but no store: `make report` must not overwrite it."""
    _, overrides = study
    moved = (*overrides, f"results_dir={tmp_path}", "tracking.experiment=never-trained")
    old = tmp_path / "smoke" / "REPORT.md"
    old.parent.mkdir(parents=True)
    old.write_text("the committed report\n")
    with pytest.raises(ConfigError, match="no tracked runs of scale 'smoke'.*is left as it is"):
        report.make_report("smoke", [1], moved)
    assert old.read_text() == "the committed report\n"


def test_smoke_never_writes_under_cpu(study):
    root, overrides = study
    run_figure(1, "smoke", [1], overrides)
    figures.make_figure(1, "smoke", [1], overrides)
    assert not (root / "cpu").exists()
    assert {p.name for p in root.iterdir()} <= {"smoke", "mlflow.db", "mlflow.db.lock", "mlartifacts"}
    assert run_config("smoke", "gspo", 1).out_dir == Path("results/smoke")
    assert run_config("cpu", "gspo", 1).out_dir == Path("results/cpu")


def test_figure_8_sweep(smoke_results, tmp_path):
    """Figure 8's lr × depth sweep at the smoke scale: each depth gets its own cold start, every cell × run ×
    seed is trained once, and every CSV row equals the seed statistics recomputed from MLflow."""
    overrides = (f"results_dir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db")
    cfgs = run_figure(8, "smoke", SEEDS, overrides)
    cells = {(c.train.lr, figures.depth(c)) for c in cfgs}
    assert len(cells) == 4 and len({run_key(c) for c in cfgs}) == len(cfgs) == 4 * 3 * len(SEEDS)
    assert {p.name for p in (tmp_path / "smoke/checkpoints").iterdir()} == {"coldstart", "coldstart-L1"}

    paths = figures.make_figure(8, "smoke", SEEDS, overrides)
    csv = pd.read_csv(paths[2])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    pairs = figure_configs(8, "smoke", SEEDS, overrides)
    exp = client.get_experiment_by_name("study-smoke")
    per = {}  # (run, lr, depth) -> [(start, final, mean volatility)] over seeds
    for name, cfg in pairs:
        rid = client.search_runs([exp.experiment_id], f"tags.run_key = '{run_key(cfg)}'")[0].info.run_id
        p = {m.step: m.value for m in client.get_metric_history(rid, mlflow_key(PASS1))}
        v = [m.value for m in client.get_metric_history(rid, f"{VOL}/overall")]
        per.setdefault((name, cfg.train.lr, figures.depth(cfg)), []).append((p[0], p[max(p)], np.mean(v)))
    curves, points, refs = (csv[csv.kind == k] for k in ("curve", "point", "reference"))
    assert len(curves) == len(points) == len(per) and len(refs) == 2 and set(csv.panel) == set("abc")
    names = [r.info.run_name for r in client.search_runs([exp.experiment_id], "attributes.run_name != 'figure-8'")]
    assert len(names) == len(set(names)) == len(pairs)  # each cell's runs named apart by their variant
    assert "gspo-nr-s1 model.num_hidden_layers=1 train.lr=" in " | ".join(names)
    for r in curves.itertuples():
        depth = int(r.cell.rsplit("=", 1)[1])
        want = seed_stats([final for _, final, _ in per[(r.run, r.x, depth)]])
        assert all(close(a, b) for a, b in zip((r.mean, r.lower, r.upper, r.n_seeds), want)), (r, want)
    for r in points.itertuples():
        lr, depth = (float(kv.split("=")[1]) for kv in r.cell.split())
        got = per[(r.run, lr, int(depth))]
        want = seed_stats([final - start for start, final, _ in got])
        assert close(r.x, float(np.mean([v for *_, v in got])))
        assert all(close(a, b) for a, b in zip((r.mean, r.lower, r.upper, r.n_seeds), want)), (r, want)
    for r in refs.itertuples():
        depth = int(r.cell.rsplit("=", 1)[1])
        starts = [s for (_, _, d), v in per.items() if d == depth for s, _, _ in v]
        assert close(r.mean, float(np.mean(starts)))
    fig_runs = client.search_runs([exp.experiment_id], "tags.figure = '8'")
    assert len(fig_runs) == 1
    assert {a.path for a in client.list_artifacts(fig_runs[0].info.run_id)} == {p.name for p in paths}

    text = report.make_report("smoke", SEEDS, overrides).read_text()
    sweep_row = [row for row in report.sections(text).values() if "(Fig. 8, ours)" in row.splitlines()[0]]
    assert len(sweep_row) == 1 and f"{len(cfgs)} of {len(cfgs)} sweep runs" in sweep_row[0]


def test_summary_table_from_tracked_runs(study):
    """analysis/summary.py: the gain column is final − step-0 pass@1 per seed, averaged, from MLflow."""
    from analysis import summary

    root, overrides = study
    run_figure(1, "smoke", SEEDS, overrides)
    text = summary.summary("smoke", ["gspo"], SEEDS, (), overrides)
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    hist = histories(client, [("gspo", run_config("smoke", "gspo", s, overrides)) for s in SEEDS])
    p = [h[mlflow_key(PASS1)] for h in hist.values()]
    gain = seed_stats([h[max(h)] - h[0] for h in p])
    row = next(line for line in text.splitlines() if line.startswith("| gspo |"))
    assert f"{gain[0]:.4f} [{gain[1]:.4f}, {gain[2]:.4f}] (n=2)" in row.split(" | ")[3]


def test_summary_refuses_runs_a_layer_makes_one():
    """An ablation that sets `algo.objective` turns `grpo` into `gspo`: the table would show one run twice."""
    from analysis import summary

    with pytest.raises(ConfigError, match="'gspo' and 'grpo' are the same run"):
        summary.summary("smoke", ["gspo", "grpo"], [1], ("experiments/ablations/gspo_clip_wide.yaml",))


def test_parallel_jobs_train_the_same_runs(study, smoke_results, tmp_path):
    """`--jobs 2` trains a figure's runs two at a time, in their own processes, and logs exactly what one
    process training them in turn logs (same config, seed and thread count, same numbers). One seed: the figure's
    two runs, one per worker process."""
    root, overrides = study
    seeds = SEEDS[:1]
    run_figure(3, "smoke", seeds, overrides)
    mine = (f"results_dir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", overrides[2])
    run_figure(3, "smoke", seeds, mine, jobs=2)
    timing = ("compute/seconds", "perf/")  # wall clock differs from run to run
    keep = lambda h: {k: v for k, v in h.items() if not k.startswith(timing)}  # noqa: E731
    want = histories(MlflowClient(f"sqlite:///{root}/mlflow.db"), figure_configs(3, "smoke", seeds, overrides))
    got = histories(MlflowClient(f"sqlite:///{tmp_path}/mlflow.db"), figure_configs(3, "smoke", seeds, mine))
    assert set(got) == set(want) and len(got) == 2
    for key in want:
        assert keep(got[key]) == keep(want[key]), key
    assert (tmp_path / "smoke" / "runs").is_dir() and len(list((tmp_path / "smoke" / "runs").iterdir())) == 2


def test_figure_9_policy_lag_sweep(smoke_results, tmp_path):
    """Figure 9 at the smoke scale: every lag × run × seed trained once; panels (a, b) are GRPO without − with
    R2 paired by seed against the no-replay runs' mean routing share, (c–e) seed statistics of the instrument
    and volatility per lag, each recomputed here from MLflow."""
    overrides = (
        f"results_dir={tmp_path}",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"init_checkpoint={smoke_results}/smoke/checkpoints/coldstart",
    )
    cfgs = run_figure(9, "smoke", SEEDS, overrides)
    assert len({run_key(c) for c in cfgs}) == len(cfgs) == 2 * 3 * len(SEEDS)
    csv = pd.read_csv(figures.make_figure(9, "smoke", SEEDS, overrides)[2])
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    pairs = figure_configs(9, "smoke", SEEDS, overrides)
    hist = {  # (run, lag, seed) -> metric -> {step: value}; one lag's runs at a time (histories() keys by seed)
        (name, lag, seed): h
        for lag in (0, 2)
        for (name, seed), h in histories(client, [p for p in pairs if p[1].rollout.policy_lag == lag]).items()
    }

    def per_run(name, lag, fn):  # seed order
        return [fn(hist[(name, lag, seed)]) for seed in SEEDS]

    last_pass = lambda h: h[mlflow_key(PASS1)][max(h[mlflow_key(PASS1)])]  # noqa: E731
    mean_of = lambda m: lambda h: float(np.mean(list(h[m].values())))  # noqa: E731
    a = csv[csv.panel == "a"]
    assert len(a) == 2 and set(a.cell) == {"rollout.policy_lag=0", "rollout.policy_lag=2"}
    for r in a.itertuples():
        lag = int(r.cell.rsplit("=", 1)[1])
        diffs = [x - y for x, y in zip(per_run("grpo", lag, last_pass), per_run("grpo_r2", lag, last_pass))]
        assert all(close(u, v) for u, v in zip((r.mean, r.lower, r.upper, r.n_seeds), seed_stats(diffs)))
        assert close(r.x, float(np.mean(per_run("grpo", lag, mean_of("moe/route/var_share")))))
    d = csv[(csv.panel == "d") & (csv.metric == "moe/route/clip_flip_token")]
    assert len(d) == 6  # 3 runs × 2 lags
    for r in d.itertuples():
        want = seed_stats(per_run(r.run, int(r.x), mean_of("moe/route/clip_flip_token")))
        assert all(close(u, v) for u, v in zip((r.mean, r.lower, r.upper, r.n_seeds), want))
    assert set(csv.panel) == set("abcde")
    text = report.make_report("smoke", SEEDS, overrides).read_text()
    row = [r for r in report.sections(text).values() if "(Fig. 9, ours), GRPO without replay falls behind" in r]
    assert len(row) == 1 and f"{len(cfgs)} of {len(cfgs)} sweep runs" in row[0] and "at lag " in row[0]
    # the figure's own report: claims 4 and 2 at the regime and the instrument's reading, from its runs alone
    path = report.make_report("smoke", SEEDS, overrides, figure=9)
    assert path.name == "REPORT-figure-9.md"
    rows = report.sections(path.read_text())
    assert sorted(rows) == [i + 1 for i, c in enumerate(report.CLAIMS) if c.figure == 9]
    table = [rows[n] for n in sorted(rows)]
    regime = int(re.search(r"regime = lag (\d+)", table[0])[1])
    assert regime in (0, 2) and f"regime = lag {regime}" in table[1] and "GSPO − GRPO + R2" in table[1]
    # the instrument's share of Var ℓ, pooled over a run's steps (Σ var / Σ total_var), and its per-step mean
    pooled = lambda h: sum(h[mlflow_key("moe/route/var")].values()) / sum(h[mlflow_key("moe/route/total_var")].values())  # noqa: E731
    share0 = float(np.mean(per_run("grpo", 0, pooled)))
    ratio0 = float(np.mean(per_run("grpo", 0, mean_of("moe/route/var_share"))))
    assert f"lag 0: share {share0:.3g} pooled ({ratio0:.3g} mean of per-step ratios)," in table[2]
    assert report.verdict_of(table[2].splitlines()[0]) == "measured"
    with pytest.raises(ConfigError, match="bad figure 3"):
        report.make_report("smoke", SEEDS, overrides, figure=3)


def test_figure_10_corrections(study):
    """Figure 10: final pass@1 (last step), final reward (last evaluation interval) and mean-over-training
    mismatch and masked fraction per run, each the seed statistics of what MLflow holds; the runs of figures 6
    and 7 are shared, not retrained."""
    root, overrides = study
    run_figure(10, "smoke", SEEDS, overrides)
    csv = pd.read_csv(figures.make_figure(10, "smoke", SEEDS, overrides)[2])
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    pairs = figure_configs(10, "smoke", SEEDS, overrides)
    hist = histories(client, pairs)
    every = {r for r, _ in pairs}
    for r in csv.itertuples():
        h = [hist[(r.run, s)][mlflow_key(r.metric)] for s in SEEDS]
        if r.panel == "a":
            values = [v[max(v)] for v in h]
        elif r.panel == "b":
            cfg = dict(pairs)[r.run]
            values = [np.mean([x for step, x in v.items() if step > cfg.train.steps - cfg.eval.every]) for v in h]
        else:
            values = [np.mean(list(v.values())) for v in h]
        assert all(close(a, b) for a, b in zip((r.mean, r.lower, r.upper, r.n_seeds), seed_stats(values))), r
    assert set(csv[csv.panel == "a"].run) == every  # one bar per run
    assert set(csv[csv.panel == "e"].run) == {r for r in every if r.endswith(("_tis", "_mis", "_icepop"))}
    path = report.make_report("smoke", SEEDS, overrides, figure=10)
    assert path.name == "REPORT-figure-10.md"
    rows = report.sections(path.read_text())
    assert sorted(rows) == [i + 1 for i, c in enumerate(report.CLAIMS) if c.figure == 10]
    table = [rows[n] for n in sorted(rows)]
    final = {r: [h[mlflow_key(PASS1)][max(h[mlflow_key(PASS1)])] for h in (hist[(r, s)] for s in SEEDS)] for r in every}
    bypass = [a - b for a, b in zip(final["gspo_bf16_rollout"], final["gspo_bf16_tis"])]
    assert "GSPO: bypass − recompute (token TIS): " in table[0] and f"Δ {np.mean(bypass):.4g}" in table[0]
    r3 = [a - b for a, b in zip(final["grpo_r3_bf16"], final["grpo_r2_bf16_recompute"])]
    assert "R3 − R2 (none): " in table[1] and f"Δ {np.mean(r3):.4g}" in table[1]
    for row in table:
        assert f"{len(pairs)} of {len(pairs)} sweep runs" in row
        assert ("no correction changes it" in row) or ("changed by " in row)


def test_long_horizon_report_rows(study):
    """Figure 11's report rows from its smoke runs (trained by the figure test above, or here): the collapse count
    per arm and claims 4 and 2 with their half-widths; the seeds-needed formula against its definition."""
    from scipy import stats

    from analysis import report, rules

    root, overrides = study
    run_figure(11, "smoke", SEEDS, overrides)
    path = report.make_report("smoke", SEEDS, overrides, figure=11)
    found = report.sections(path.read_text())
    assert sorted(found) == [5, 13, 14, 15]  # claim 5 is judged on figure 11's runs too
    rows = [found[n] for n in (13, 14, 15)]
    assert "GRPO (no replay), bf16 rollout, recomputed π_old: " in rows[0] and " of 2 collapsed [" in rows[0]
    assert "GRPO + R2, bf16 rollout, IcePop: " in rows[0]  # all five arms counted
    assert "collapse rule: version 2 in force" in rows[0] and "version 1 (" in rows[0]
    assert "half-width" in rows[1] and "(n=2)" in rows[1]
    for sd in (0.01, 0.05, 0.1):
        n = rules.seeds_needed(sd)
        assert stats.t.ppf(0.975, n - 1) * sd / n**0.5 <= 0.05 < stats.t.ppf(0.975, n - 2) * sd / (n - 1) ** 0.5


def test_report_names_a_store_under_the_repository_relatively():
    from analysis.report import _shown_uri

    root = Path(__file__).resolve().parents[1]
    assert _shown_uri(f"sqlite:///{root}/results/mlflow.db") == "sqlite:///results/mlflow.db"
    assert _shown_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
