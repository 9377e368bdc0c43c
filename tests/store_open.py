"""What a spawned process of tests/test_reliability.py's store race runs: open an MLflow store, nothing else (a
spawned child imports this module, not the test module's torch, transformers and trainer)."""

from __future__ import annotations


def open_store(uri: str) -> str:
    from gspo_study.tracking import _connect

    _, exp_id = _connect(uri, "race")
    return exp_id
