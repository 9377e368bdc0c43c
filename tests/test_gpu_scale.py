"""The gpu scale (experiments/gpu/): every figure's runs resolve to valid configs there, and docs/SCALE.md's sizes
— the model's parameters and the per-figure table of runs, steps, estimated peak memory and time — are the ones
`benchmarks/gpu_scale.py` computes from the configs (a config change that moves them fails until the docs follow)."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import gpu_scale
from gspo_study.models.presets import active_params

ROOT = Path(__file__).resolve().parents[1]


def test_docs_gpu_scale_block_is_the_scripts():
    rows = gpu_scale.rows()
    assert {r["figure"] for r in rows} >= {"1", "8", "9", "11"} and all(r["runs"] > 0 for r in rows)
    assert gpu_scale.written() == gpu_scale.block(rows), "run: python -m benchmarks.gpu_scale --write"


def test_docs_model_sizes_are_the_presets():
    model = gpu_scale.model_of("qwen3-moe-mini", None)
    total, active = sum(p.numel() for p in model.parameters()), active_params(model.config)
    text = (ROOT / "docs" / "SCALE.md").read_text()
    said = re.search(r"at hidden size 128, (\d+) M\s+parameters of which ([\d.]+) M are active", text)
    assert said, "docs/SCALE.md no longer states the miniature's sizes"
    assert (int(said[1]), float(said[2])) == (round(total / 1e6), round(active / 1e6, 1))
    state = re.search(r"copy 2 B: 18 B × (\d+) M = ([\d.]+) GB of state", text)
    assert state and int(state[1]) == round(total / 1e6) and float(state[2]) == round(18 * total / 1e9, 1)
    lag = re.search(r"adds k \+ 2 fp32 copies, ([\d.]+) GB more at k = 8", text)
    assert lag and float(lag[1]) == round(10 * 4 * total / 1e9, 1)
