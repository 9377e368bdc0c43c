"""A real `mlflow server` over a store holding the smoke runs of figure 1 and the figure itself: its REST API
(plain urllib, no MLflow client) shows the runs' params, tags, metric histories and the figure artifacts.
Every wait is bounded and the server's whole process group is stopped in teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from analysis.figures import make_figure
from gspo_study.run import run_key
from gspo_study.study import figure_configs, run_figure

from .servers import free_port, stop_group, wait_ready

ROOT = Path(__file__).resolve().parents[1]
READY_S = 60
TIMEOUT_S = 10  # per HTTP request


@pytest.fixture(scope="module")
def server(smoke_results, tmp_path_factory):
    """(base URL, study overrides) of a server over a fresh store with figure 1's runs (seed 1)."""
    root = tmp_path_factory.mktemp("served")
    overrides = (
        f"results_dir={root}",
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"init_checkpoint={smoke_results}/smoke/checkpoints/coldstart",
    )
    run_figure(1, "smoke", [1], overrides)
    make_figure(1, "smoke", [1], overrides)
    port = free_port()
    cmd = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--backend-store-uri",
        f"sqlite:///{root}/mlflow.db",
        "--artifacts-destination",
        str(root / "mlartifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    log = open(root / "server.log", "w")  # closed in teardown, after the server stops
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # as `make mlflow-ui`: no GenAI job runner
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, root / "server.log", "mlflow server", READY_S)
        yield url, overrides
    finally:
        stop_group(proc)
        log.close()


def _get(url: str, path: str, **query) -> dict:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(query)}", timeout=TIMEOUT_S) as r:
        return json.loads(r.read())


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        return json.loads(r.read())


def _search(url: str, exp_id: str, filter_string: str) -> list[dict]:
    body = {"experiment_ids": [exp_id], "filter": filter_string, "max_results": 10}
    return _post(url, "/api/2.0/mlflow/runs/search", body).get("runs", [])


def test_rest_api_serves_runs_metrics_and_figure(server):
    url, overrides = server
    exp = _get(url, "/api/2.0/mlflow/experiments/get-by-name", experiment_name="study-smoke")["experiment"]
    for name, cfg in figure_configs(1, "smoke", [1], overrides):
        runs = _search(url, exp["experiment_id"], f"tags.run_key = '{run_key(cfg)}'")
        assert len(runs) == 1, name
        run = runs[0]
        assert run["info"]["status"] == "FINISHED"
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert params["algo.objective"] == cfg.algo.objective
        assert params["algo.routing_replay"] == cfg.algo.routing_replay
        assert tags["algorithm"] == cfg.algo.objective and tags["routing_replay"] == cfg.algo.routing_replay
        assert tags["seed"] == "1" and len(tags["git_commit"]) > 0
        hist = _get(
            url, "/api/2.0/mlflow/metrics/get-history", run_id=run["info"]["run_id"], metric_key="rollout/reward/mean"
        )["metrics"]
        assert sorted(m["step"] for m in hist) == [1, 2, 3]
        assert all(0.0 <= m["value"] <= 1.0 for m in hist)

    figure_runs = _search(url, exp["experiment_id"], "tags.figure = '1'")
    assert len(figure_runs) == 1 and figure_runs[0]["info"]["run_name"] == "figure-1"
    listed = _get(url, "/api/2.0/mlflow/artifacts/list", run_id=figure_runs[0]["info"]["run_id"])
    assert {f["path"] for f in listed["files"]} >= {"figure-1.png", "figure-1.pdf", "figure-1.csv"}
    query = urllib.parse.urlencode({"path": "figure-1.csv", "run_uuid": figure_runs[0]["info"]["run_id"]})
    with urllib.request.urlopen(f"{url}/get-artifact?{query}", timeout=TIMEOUT_S) as r:
        served = r.read().decode()
    assert served == (Path(overrides[0].split("=", 1)[1]) / "smoke" / "figure-1.csv").read_text()
