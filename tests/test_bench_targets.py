"""benchmarks/targets.py: issue 50's verdicts read from the bench JSON, met and not met on built data."""

from benchmarks.targets import readings


def _bench(gspo: float, grpo: float, rollout: float) -> dict:
    return {
        "ratios": {
            "ours-gspo (incl. telemetry) / trl-gspo": gspo,
            "ours-grpo-r2 (incl. telemetry) / trl-grpo": grpo,
        },
        "floor": {"runs": {"ours-gspo": {"phase_efficiency": {"rollout": rollout}}}},
    }


def _telemetry(share: float) -> dict:
    return {"summary": {"telemetry_share_of_step": {"1.0": 0.3, "0.25": share}}}


def test_every_target_can_pass_and_fail():
    met = readings(_bench(1.6, 1.5, 0.15), _telemetry(0.05), 899.0)
    assert [r["met"] for r in met] == [True] * 5
    missed = readings(_bench(1.49, 1.2, 0.149), _telemetry(0.051), 901.0)
    assert [r["met"] for r in missed] == [False] * 5
    assert [r["value"] for r in missed] == [1.49, 1.2, 0.149, 0.051, 901.0]


def test_a_missing_measurement_is_not_a_verdict():
    rows = readings({}, {}, None)
    assert all(r["value"] is None and r["met"] is None for r in rows)
