"""Shared fixtures: a smoke-scale cold-start checkpoint built once per session, in a temp results dir."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.pop("MLFLOW_TRACKING_URI", None)
torch.set_num_threads(1)

SMOKE = "experiments/smoke/base.yaml"

# `make test` runs the files on two workers (`--dist loadfile --no-loadscope-reorder`), each file whole, in the order
# collected: the longest first (seconds per file on a 2-core machine, docs/LOG.md 2026-12-04), so that the two
# workers finish together instead of one idling while the other runs a long file last. A file not listed runs after
# these, in its usual order; the weights only order, they skip nothing.
LONGEST_FIRST = {
    "test_vllm_server.py": 146,
    "test_figures.py": 141,
    "test_gpu_check.py": 110,
    "test_reliability.py": 87,
    "test_reliability_table.py": 84,
    "test_deepspeed.py": 84,
    "test_vllm_engine.py": 76,
    "test_mlflow_ui.py": 53,
    "test_archive.py": 39,
    "test_sigterm.py": 55,
    "test_failed_writes.py": 39,
    "test_trainer.py": 17,
    "test_policy_lag.py": 11,
    "test_mlflow_server.py": 9,
    "test_identity.py": 8,
}


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
