"""Each figure declared once: its entry in experiments/figures.yaml.

An entry holds what runs the figure needs (`runs`, `sweep`, `seeds`, `dropped`: read by gspo_study.study) and what
the analysis makes of them, read here:

    title     the figure's title
    draw      the function that turns its Study into panels, a dotted path (`analysis.mechanism_figures.panels`)
    what      its line in docs/FIGURES.md's table
    short     its line in the README's table
    claims    the REPORT.md rows it draws (their estimates and verdicts fill both lines); [] for none
    no_claim  what the lines say where no row fills them (optional)
    frontier  the frontier axes its lines quote from REPORT.md's frontier section (figures 13-16; optional)

`analysis.figures` draws from `draw`; `analysis.doc_blocks` writes both tables from the rest; tests/test_registry.py
checks every entry resolves. A new figure is one entry (and, if no existing function draws it, one function)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from gspo_study.config import ConfigError
from gspo_study.paths import EXPERIMENTS
from gspo_study.study import figures

REQUIRED = ("title", "draw", "what", "short")


@dataclass(frozen=True)
class Entry:
    number: int
    title: str
    draw: str
    what: str
    short: str
    claims: tuple[int, ...] = ()
    no_claim: str = ""
    frontier: tuple[str, ...] = ()


def _entry(name: str, spec: dict) -> Entry:
    missing = [k for k in REQUIRED if not isinstance(spec.get(k), str) or not spec[k]]
    if missing:
        raise ConfigError(f"figures.yaml: {name} has no {', '.join(missing)}; allowed: a non-empty string each")
    claims = spec.get("claims", [])
    if not isinstance(claims, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in claims):
        raise ConfigError(f"figures.yaml: {name}'s claims {claims!r}; allowed: a list of REPORT.md row numbers")
    frontier = spec.get("frontier", [])
    if not isinstance(frontier, list) or not all(isinstance(a, str) for a in frontier):
        raise ConfigError(f"figures.yaml: {name}'s frontier {frontier!r}; allowed: a list of axis names")
    return Entry(
        number=int(name.removeprefix("figure-")),
        title=spec["title"],
        draw=spec["draw"],
        what=spec["what"],
        short=spec["short"],
        claims=tuple(claims),
        no_claim=str(spec.get("no_claim", "")),
        frontier=tuple(frontier),
    )


def entries(experiments: Path = EXPERIMENTS) -> dict[int, Entry]:
    """Every figure's entry, by number, in number order (read afresh: the file is small)."""
    found = (_entry(k, v) for k, v in figures(Path(experiments)).items())
    return {e.number: e for e in sorted(found, key=lambda e: e.number)}


def resolve(path: str) -> Callable:
    """The function a `draw` path names; a one-line error naming the path if there is none."""
    module, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        fn = None
    if not callable(fn):
        raise ConfigError(f"figures.yaml: draw {path!r} names no function; allowed: a dotted path module.function")
    return fn


class Drawings(Mapping):
    """figure number → its panels function, resolved when first asked for (the drawing modules import lazily)."""

    def __init__(self, experiments: Path = EXPERIMENTS):
        self.experiments = experiments

    def __getitem__(self, figure: int) -> Callable:
        found = entries(self.experiments)
        if figure not in found:
            raise KeyError(figure)
        return resolve(found[figure].draw)

    def __iter__(self) -> Iterator[int]:
        return iter(entries(self.experiments))

    def __len__(self) -> int:
        return len(entries(self.experiments))
