"""benchmarks/bench_ab.py's pure parts: the key-by-key comparison (must tell equal from different numbers), the
per-step seconds read from log times, and the pair-by-pair ratios."""

import math
import sqlite3

import pytest

from benchmarks.bench_ab import compare, load_metrics, pair_summary, parse_args, seconds_per_step, step_times


def test_compare_tells_equal_different_and_unmatched_keys():
    a = {("loss", 1): 0.5, ("loss", 2): 0.25, ("moe/route/x", 1): 0.1, ("eval/pass@1", 0): float("nan"),
         ("perf/tokens_per_s", 1): 100.0, ("only_a", 1): 1.0, ("late", 1): 2.0}  # fmt: skip
    b = dict(a)
    b[("moe/route/x", 1)] = math.nextafter(0.1, 1.0)  # one ulp away: not the same number
    b[("perf/tokens_per_s", 1)] = 90.0  # timing: never compared
    del b[("only_a", 1)]
    b[("late", 2)] = b.pop(("late", 1))
    out = compare(a, b)
    assert out == {"same": ["eval/pass@1", "loss"], "differ": ["moe/route/x"], "unmatched": ["late", "only_a"]}


def test_step_seconds_and_pairs_from_a_store(tmp_path):
    db = tmp_path / "m.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE metrics (key TEXT, step INT, value REAL, timestamp INT)")
        # steps 1..5 logged at 0, 10, 12, 14 and 17 s: steps 2..5 took 10, 2, 2 and 3 s
        for step, ms in zip(range(1, 6), (0, 10_000, 12_000, 14_000, 17_000)):
            con.execute("INSERT INTO metrics VALUES ('rollout/reward/mean', ?, 0.5, ?)", (step, ms))
    assert load_metrics(db) == {("rollout/reward/mean", s): 0.5 for s in range(1, 6)}
    assert seconds_per_step(step_times(db)) == pytest.approx(2.5)  # median of 10, 2, 2, 3
    runs = [{"side": s, "warmup": w, "wall_s": wall, "step_s": step}
            for s, w, wall, step in [("A", True, 9, 9), ("B", True, 9, 9), ("A", False, 8, 1.6), ("B", False, 10, 2.0),
                                     ("A", False, 9, 1.8), ("B", False, 10, 2.0)]]  # fmt: skip
    summary = pair_summary(runs)
    assert summary["median_step_a_over_b"] == pytest.approx(0.85)  # pairs 0.8 and 0.9; the warm-up pair left out
    assert summary["median_wall_s"] == {"A": 8.5, "B": 10}


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--before", "HEAD", "--steps", "2"])
    assert "--steps 2: at least 3" in capsys.readouterr().err
