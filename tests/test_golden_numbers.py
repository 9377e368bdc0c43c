"""Training numbers are pinned like run identities: the first steps of a handful of smoke runs (tests/golden/regen.py
says which, and why) give exactly the numbers in tests/golden/numbers.json. A change to the numerics that keeps every
run key fails here until the file is regenerated on purpose (`python -m tests.golden.regen`, its diff reviewed).

The runs, and their cold start, are computed in a child process whose kernels are forced to AVX2 (`regen.FORCED`),
one entry per CPU vendor (the forcing does not make Intel and AMD agree: regen's docstring); a CPU without AVX2 and FMA,
or of a vendor with no entry yet, skips."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from tests.golden import regen


def moved_numbers(got: dict, golden: dict, later: frozenset[str] = frozenset()) -> dict[str, tuple[float, float]]:
    """`label: (pinned, now)` for every number of `got` that is not exactly the pinned one (NaN equals NaN), and for
    every metric one side has and the other lacks — except a metric in `later`: one added after this entry was pinned
    and pinned in another vendor's entry since (a new telemetry key; the numbers pinned here are all still checked)."""
    moved = {}
    for name, steps in golden.items():
        for step, (want, have) in enumerate(zip(steps, got.get(name, [])), 1):
            for key in sorted(want.keys() | have.keys()):
                a, b = want.get(key, math.nan), have.get(key, math.nan)
                if key not in want and key in later:
                    continue
                if key not in want or key not in have or not (a == b or a != a and b != b):
                    moved[f"{name} step {step} {key}"] = (a, b)
    return moved


def pinned_later(pinned: dict, vendor: str) -> frozenset[str]:
    """The metrics other vendors' entries pin and `vendor`'s lacks (added since it was pinned)."""
    keys = lambda entry: {k for steps in entry["runs"].values() for step in steps for k in step}  # noqa: E731
    mine = keys(pinned["by_vendor"][vendor])
    return frozenset(set().union(*(keys(e) for v, e in pinned["by_vendor"].items() if v != vendor)) - mine)


def test_the_pinned_runs_cover_every_objective_replay_mode_dtype_and_a_correction():
    from gspo_study.moe.modes import REPLAY_MODES
    from gspo_study.objectives.core import OBJECTIVES

    cfgs = [regen.config(name) for name in regen.RUNS]
    assert {c.algo.objective for c in cfgs} == set(OBJECTIVES)
    assert {c.algo.routing_replay for c in cfgs} == set(REPLAY_MODES)
    assert {c.rollout.dtype for c in cfgs} == {"float32", "bfloat16"}
    assert any(c.algo.rollout_correction != "none" for c in cfgs)
    assert {c.algo.aggregation for c in cfgs} == {"seq_mean", "token_mean"}
    assert {c.algo.old_logprobs for c in cfgs} == {"recompute", "rollout"}


def test_training_numbers_are_the_pinned_ones():
    pinned = json.loads(regen.GOLDEN.read_text())
    assert pinned["forced"] == regen.FORCED, "the pinned kernels changed: python -m tests.golden.regen"
    golden = pinned["by_vendor"].get(regen.vendor())
    if golden is None:
        pytest.skip(f"no pinned numbers for {regen.vendor()} CPUs yet: python -m tests.golden.regen adds them")
    others = {run for v, e in pinned["by_vendor"].items() if v != regen.vendor() for run in e["runs"]}
    newer = [run for run in regen.RUNS if run not in golden["runs"] and run in others]  # pinned elsewhere since
    assert [r for r in regen.RUNS if r not in newer] == list(golden["runs"]), (
        "the pinned runs changed: python -m tests.golden.regen"
    )
    if newer:
        warnings.warn(f"runs {newer} are pinned for other CPU vendors only: python -m tests.golden.regen here pins "
                      "them too", stacklevel=1)  # fmt: skip
    got = regen.forced_numbers()
    if got is None:
        pytest.skip(regen.NO_AVX2)
    later = pinned_later(pinned, regen.vendor())
    if later:
        warnings.warn(f"{len(later)} metrics are pinned for other CPU vendors only (e.g. {sorted(later)[0]}): "
                      "python -m tests.golden.regen on this vendor pins them here too", stacklevel=1)  # fmt: skip
    moved = moved_numbers(got["runs"], golden["runs"], later)
    assert not moved, (
        f"{len(moved)} pinned numbers moved (pinned with torch {golden['torch']}, transformers "
        f"{golden['transformers']}, {golden['blas']}; here {got['torch']}, {got['transformers']}, {got['blas']}), "
        f"e.g. {dict(list(moved.items())[:3])}; if the change is meant: python -m tests.golden.regen, and review "
        "the diff of tests/golden/numbers.json"
    )


def test_a_moved_number_is_named():
    golden = {"gspo": [{"policy/loss": 0.25, "train/grad_norm": math.nan}]}
    assert moved_numbers(golden, golden) == {}
    nudged = {"gspo": [{"policy/loss": math.nextafter(0.25, 1.0), "train/grad_norm": math.nan}]}
    assert list(moved_numbers(nudged, golden)) == ["gspo step 1 policy/loss"]  # one ulp is a move
    extra = {"gspo": [{**golden["gspo"][0], "policy/new": 1.0}]}
    assert list(moved_numbers(extra, golden)) == ["gspo step 1 policy/new"]
    # a metric pinned on another vendor since is not a move here; a pinned number that moves still is
    assert moved_numbers(extra, golden, frozenset({"policy/new"})) == {}
    assert list(moved_numbers({"gspo": [{**nudged["gspo"][0], "policy/new": 1.0}]}, golden, frozenset({"policy/new"})))
    two = {"forced": {}, "by_vendor": {"A": {"runs": golden}, "B": {"runs": extra}}}
    assert pinned_later(two, "A") == {"policy/new"} and pinned_later(two, "B") == frozenset()
