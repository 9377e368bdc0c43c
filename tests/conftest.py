"""Shared fixtures: a smoke-scale cold-start checkpoint built once per session, in a temp results dir."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.pop("MLFLOW_TRACKING_URI", None)
torch.set_num_threads(1)

SMOKE = "experiments/smoke/base.yaml"

# `make test` runs the files on two workers (`--dist loadfile --no-loadscope-reorder`), each file whole, in the order
# collected: the longest first (seconds per file in a clean clone, results/test_times.json, benchmarks/test_times.py),
# so that the two workers finish together instead of one idling while the other runs a long file last. A file not
# listed runs after these, in its usual order; the weights only order, they skip nothing.
TIMES = Path(__file__).resolve().parents[1] / "results" / "test_times.json"
LONGEST_FIRST = json.loads(TIMES.read_text())["per_file_s"]


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))  # stable: a file's own order is kept


@pytest.fixture(scope="session")
def smoke_results(tmp_path_factory):
    """A results dir holding the smoke cold-start checkpoint."""
    from gspo_study.config import load_config
    from gspo_study.sft import run_sft

    root = tmp_path_factory.mktemp("results")
    run_sft(load_config(SMOKE, [f"results_dir={root}"]))
    return root


@pytest.fixture
def smoke_cfg(smoke_results, tmp_path):
    """Factory: a smoke config whose results and MLflow store are private to the test (the cold start is shared)."""
    from gspo_study.config import load_config

    def make(*overrides: str):
        return load_config(
            SMOKE,
            [
                f"results_dir={tmp_path / 'results'}",
                f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                f"init_checkpoint={smoke_results}/smoke/checkpoints/coldstart",
                *overrides,
            ],
        )

    return make
