"""Numbers in the docs reach them one way: analysis/doc_blocks.py's marked blocks. The measured ones (the memory
estimate's error, our speed against TRL, `make test`'s time) are their measurements' JSON, and a changed measurement
makes its document stale until the block is rewritten."""

from __future__ import annotations

import json

from analysis import doc_blocks


def test_measured_blocks_are_their_measurements():
    assert doc_blocks.stale_measured() == [], "run: python -m analysis.doc_blocks"
    for path, writers in doc_blocks.MEASURED.items():
        assert {m["name"] for m in doc_blocks.BLOCK.finditer(path.read_text())} == set(writers), path


def test_a_changed_measurement_is_caught(tmp_path):
    """The blocks read the JSON the benchmark wrote: change one number there and the document no longer agrees."""
    path = doc_blocks.ROOT / "docs" / "RELIABILITY.md"
    text = path.read_text()
    bench = json.loads((doc_blocks.ROOT / "results" / "bench_memory.json").read_text())
    bench["cases"][0]["measured_step_mib"] += 100
    (tmp_path / "bench_memory.json").write_text(json.dumps(bench))
    changed = doc_blocks.rewrite(text, {"bench-memory": doc_blocks._bench_memory(tmp_path)})
    assert changed != text and f"| {bench['cases'][0]['measured_step_mib']:.0f} MiB |" in changed
    targets = json.loads((doc_blocks.ROOT / "results" / "bench_targets.json").read_text())
    targets["targets"][0].update(value=1.6, met=True)  # a step at 1.6x TRL's: the table must say it is met
    (tmp_path / "bench_targets.json").write_text(json.dumps(targets))
    block = doc_blocks._bench_targets(tmp_path)
    assert f"| {targets['targets'][0]['target']} | 1.6 | ≥ 1.5 | met |" in block
    ab = json.loads((doc_blocks.ROOT / "results" / "bench_ab_study.json").read_text())
    ab["numbers"]["differ"].append("train/loss")  # a training number that moved: the line must say so
    (tmp_path / "bench_ab_study.json").write_text(json.dumps(ab))
    line = doc_blocks._bench_ab(tmp_path)
    assert f"{len(ab['numbers']['differ'])} differ (" in line and "`train/*`" in line


def test_test_time_is_one_file():
    """`make test`'s time: README's block and the test files' order (tests/conftest.py) read results/test_times.json."""
    from tests import conftest

    times = json.loads((doc_blocks.ROOT / "results" / "test_times.json").read_text())
    assert conftest.LONGEST_FIRST == times["per_file_s"]
    tests = [c["tests_s"] / 60 for c in times["clean_clones"]]
    said = doc_blocks._test_time()
    assert f"of which {min(tests):.0f}–{max(tests):.0f} min of tests" in said
    assert said in (doc_blocks.ROOT / "README.md").read_text()
