"""The gpu scale (experiments/gpu/): every figure's runs resolve to valid configs there, and docs/GPU.md's sizes
— the model's parameters and the per-figure table of runs, steps, estimated peak memory and time — are the blocks
analysis/doc_blocks.py writes from what `benchmarks/gpu_scale.py` computes from the configs (a config change that
moves them fails until the docs follow)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import gpu_scale
from gspo_study.models.presets import active_params

ROOT = Path(__file__).resolve().parents[1]


def _blocks() -> dict[str, str]:
    from analysis import doc_blocks

    return {m["name"]: m["body"] for m in doc_blocks.BLOCK.finditer((ROOT / "docs" / "GPU.md").read_text())}


def test_docs_gpu_scale_block_is_the_scripts():
    rows = gpu_scale.rows()
    assert {r["figure"] for r in rows} >= {"1", "8", "9", "11"} and all(r["runs"] > 0 for r in rows)
    assert _blocks()["gpu-scale"] == gpu_scale.table(rows) + "\n", "run: python -m analysis.doc_blocks"


def test_docs_model_sizes_are_the_presets():
    """docs/GPU.md's `gpu-model` block is `model_sizes()`, whose numbers are the model's, counted here."""
    model = gpu_scale.model_of("qwen3-moe-mini", None)
    total, active = sum(p.numel() for p in model.parameters()), active_params(model.config)
    said = gpu_scale.model_sizes()
    assert _blocks()["gpu-model"] == said + "\n", "run: python -m analysis.doc_blocks"
    assert f"{total / 1e6:.0f} M parameters, {active / 1e6:.1f} M of them active" in said
    assert f"is {18 * total / 1e9:.1f} GB" in said and f"{10 * 4 * total / 1e9:.1f} GB more at k = 8" in said


def test_the_report_skips_what_a_scale_has_no_runs_of():
    """The frontier's stages run at the smoke and cpu scales only: `make report SCALE=gpu` leaves their sections out
    and a claim on a figure without runs there says "not run", instead of refusing the whole report."""
    from gspo_study.study import drawn_at

    assert drawn_at(1, "gpu") and drawn_at(11, "gpu") and not drawn_at(13, "gpu") and not drawn_at(18, "gpu")
    assert not drawn_at(11, "paper") and drawn_at(13, "cpu")
