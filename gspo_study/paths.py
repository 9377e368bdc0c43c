"""Where the experiment files live: `experiments/<scale>/base.yaml`, `experiments/runs/`, `figures.yaml`.

Below tracking and the trainer (both need a scale's base config), above nothing but the config.
"""

from __future__ import annotations

from pathlib import Path

from gspo_study.errors import ConfigError

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def scale_base(scale: str, experiments: Path = EXPERIMENTS) -> Path:
    path = experiments / scale / "base.yaml"
    if not path.is_file():
        allowed = sorted(p.parent.name for p in experiments.glob("*/base.yaml"))
        raise ConfigError(f"unknown scale {scale!r}; allowed: {', '.join(allowed)}")
    return path
