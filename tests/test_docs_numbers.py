"""Numbers in docs that come from measurements are the measurements' own (written from their JSON)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reliability_memory_table_is_the_benchmark_json():
    from benchmarks import bench_memory

    text = (ROOT / "docs/RELIABILITY.md").read_text()
    block = text.split("checked by tests/test_docs_numbers.py -->\n", 1)[1].split("\n<!-- end -->", 1)[0]
    assert block == bench_memory.table(json.loads((ROOT / "results/bench_memory.json").read_text()))
