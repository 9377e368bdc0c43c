"""`make test`'s measured time, in one place: results/test_times.json, from a pytest JUnit report of a clean clone.

    rm -rf /tmp/ci && git clone -q . /tmp/ci && cd /tmp/ci && \\
        time PYTEST_ADDOPTS=--junitxml=/tmp/ci-tests.xml make test        # note the wall time, N seconds
    python -m benchmarks.test_times /tmp/ci-tests.xml --total-s N --commit <hash> --machine "2-core AVX2 EPYC"

It adds the clone to `clean_clones` (its test time: the report's, its total: N, both environments built) and sets
`per_file_s` (each test file's seconds, summed over its tests), which orders the files on the two pytest workers
(tests/conftest.py). README's `test-time` block is written from the file by analysis/doc_blocks.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMES = ROOT / "results" / "test_times.json"


def per_file(report: Path) -> tuple[dict[str, int], float]:
    """(seconds per test file, the report's test time) of a JUnit XML report."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    files: dict[str, float] = defaultdict(float)
    for case in root.iter("testcase"):
        name = case.get("classname", "").split(".")
        module = next((p for p in name if p.startswith("test_")), None)
        if module:
            files[f"{module}.py"] += float(case.get("time", 0))
    ordered = sorted(((f, round(s)) for f, s in files.items() if s >= 5), key=lambda kv: -kv[1])
    return dict(ordered), sum(float(s.get("time", 0)) for s in suites)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="pytest --junitxml report of a whole `make test`")
    p.add_argument("--total-s", type=float, required=True, help="wall time of `make test` in the clean clone")
    p.add_argument("--commit", required=True)
    p.add_argument("--machine", required=True, help='e.g. "2-core AVX-512-BF16 EPYC"')
    args = p.parse_args(argv)
    files, tests_s = per_file(args.report)
    old = json.loads(TIMES.read_text()) if TIMES.exists() else {"clean_clones": []}
    same = [c for c in old["clean_clones"] if old.get("machine") == args.machine]  # other machines' times go
    clone = {"commit": args.commit, "tests_s": round(tests_s), "total_s": round(args.total_s)}
    new = {"measured": date.today().isoformat(), "machine": args.machine, "clean_clones": [*same, clone]}
    TIMES.write_text(json.dumps({**new, "per_file_s": files}, indent=2) + "\n")
    print(f"{TIMES.relative_to(ROOT)}: {clone}; rewrite the README with python -m analysis.doc_blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
