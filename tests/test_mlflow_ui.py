"""`make mlflow-ui`, for real: the URLs it prints, opened in headless Chromium against the `mlflow ui` server it
starts on loopback, show the study in model-training mode — the runs table with the training runs' names (and
not the figure run), metric charts, and the figure runs on their own page.

Chromium is Debian's `chromium`, installed by the test when missing (apt-get, as root); in CI (CI=true) a
machine without it is a failure, elsewhere a skip naming the command. MLflow's UI is a JS app: pages are read
with `--dump-dom` after `--virtual-time-budget` lets it render."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from analysis.figures import make_figure
from gspo_study.study import run_figure

from .servers import free_port, stop_group, wait_ready

ROOT = Path(__file__).resolve().parents[1]
APT = "apt-get install -y --no-install-recommends chromium"
READY_S = 90
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]


def chromium() -> str:
    """The chromium binary, installed with apt-get if missing and possible."""
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        for cmd in (APT, f"apt-get update -q && {APT}"):  # the package lists may be missing or stale
            subprocess.run(cmd, shell=True, capture_output=True, timeout=900)
            if found := shutil.which("chromium"):
                break
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"headless Chromium is missing and `{APT}` did not install it")
        pytest.skip(f"headless Chromium is missing: install it with `sudo {APT}`")
    return found


@pytest.fixture(scope="module")
def ui(smoke_results, tmp_path_factory):
    """(printed text, tmp dir) of `make mlflow-ui` serving a store with figure 1's smoke runs and the figure."""
    browser = chromium()
    root = tmp_path_factory.mktemp("ui")
    # the shared cold start at this results dir's own path (not init_checkpoint, which is part of a run's identity):
    # the runs then carry the keys figure 1 computes, and `make mlflow-ui` can tag them with it
    (root / "smoke" / "checkpoints").mkdir(parents=True)
    (root / "smoke" / "checkpoints" / "coldstart").symlink_to(smoke_results / "smoke" / "checkpoints" / "coldstart")
    overrides = (f"results_dir={root}", f"tracking.uri=sqlite:///{root}/mlflow.db")
    run_figure(1, "smoke", [1], overrides)
    make_figure(1, "smoke", [1], overrides)
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{root}/mlflow.db"}
    log = open(root / "ui.log", "w")  # closed in teardown, after the server stops
    cmd = ["make", "--no-print-directory", "mlflow-ui", f"PORT={port}", "MLFLOW_WORKERS=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, root / "ui.log", "make mlflow-ui", READY_S)
        yield (root / "ui.log").read_text(), root, browser
    finally:
        stop_group(proc)
        log.close()


def dom(browser: str, url: str, profile: Path, ready: tuple[str, ...] = ()) -> str:
    """The page's DOM once MLflow's app has rendered it (a fresh profile: no remembered UI mode). On a loaded
    machine the app can still be fetching when the virtual-time budget ends: up to 3 tries, until every `ready`
    string is on the page (the test's assertions then judge the last DOM)."""
    for attempt, budget in enumerate((10_000, 30_000, 60_000)):  # virtual ms; more on each retry
        done = subprocess.run(
            [
                browser,
                *FLAGS,
                f"--virtual-time-budget={budget}",
                f"--user-data-dir={profile}-{attempt}",
                "--dump-dom",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        if all(r in done.stdout for r in ready):
            break
    return done.stdout


def printed(text: str, what: str) -> str:
    """The URL `make mlflow-ui` printed for `what` (runs table / metric charts / figure/report runs)."""
    found = re.findall(rf"{re.escape(what)}:\s+(http://\S+)", text)
    assert len(found) == 1, text
    return found[0]


def test_make_mlflow_ui_prints_working_training_pages(ui):
    text, root, browser = ui
    exp_id = re.search(r"study-smoke \(experiment (\d+)\)", text)
    assert exp_id, text
    runs, charts, passed, figures = (
        printed(text, w) for w in ("runs table", "metric charts", "held-out pass@1", "figure/report runs")
    )
    for url in (runs, charts, passed, figures):
        assert f"/#/experiments/{exp_id[1]}/runs?" in url and url.endswith("workflowType=machine_learning")
    assert "compareRunsMode=CHART" in charts and "/chart?" not in charts

    table = dom(browser, runs, root / "profile-runs", ("gspo-nr-s1", "grpo-r2-s1"))
    assert "gspo-nr-s1" in table and "grpo-r2-s1" in table  # the training runs, by name
    assert "figure-1" not in table  # the figure run is filtered out
    assert "Model registry" in table and "Judges" not in table  # model-training mode, not GenAI's sidebar

    page = dom(browser, charts, root / "profile-charts", ("gspo-nr-s1", "js-plotly-plot", "eval/pass_at_1"))
    assert "gspo-nr-s1" in page and "js-plotly-plot" in page  # rendered metric charts
    assert "eval/pass_at_1" in page and "figure-1" not in page

    # the shared view: the training runs' charts, searched down to held-out pass@1 (MLflow's charts lay out
    # every metric in name order, so with many metrics pass@1 is below the first screen)
    only = dom(browser, passed, root / "profile-pass", ("gspo-nr-s1", "js-plotly-plot", "shared view"))
    assert "shared view" in only and 'value="eval/pass_at_1"' in only and "gspo-nr-s1" in only
    assert "eval/pass_at_1" in only and "policy/loss" not in only and "figure-1" not in only
    assert "Model registry" in only and "Judges" not in only

    drawn = dom(browser, figures, root / "profile-figures", ("figure-1",))
    assert "figure-1" in drawn and "gspo-nr-s1" not in drawn

    # a figure's own page: its runs only (tagged `figures` by `make mlflow-ui`)
    own = dom(browser, printed(text, "figure 1 runs"), root / "profile-figure-1", ("gspo-nr-s1",))
    assert "gspo-nr-s1" in own and "grpo-r2-s1" in own and "figure-1" not in own


def test_mlflow_urls_of_an_empty_or_unreachable_store(tmp_path, capsys):
    """No study runs yet: a line saying how to get some; a server that is not there: a one-line error (exit 2)."""
    from gspo_study.cli import main

    assert main(["mlflow-urls", "--uri", f"sqlite:///{tmp_path}/new.db"]) == 0
    assert "no study runs in" in capsys.readouterr().out
    uri = f"http://127.0.0.1:{free_port()}"
    assert main(["mlflow-urls", "--uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and uri in err[0] and "unreachable" in err[0]
