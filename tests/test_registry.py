"""Each figure declared once (analysis/registry.py): every entry of experiments/figures.yaml resolves to a drawing and
its lines in the docs; a toy figure added as one entry appears in FIGURES and in both docs' tables; a bad entry is a
one-line error naming the figure and the field. No training, no drawing: about a second."""

from __future__ import annotations

import pytest

from analysis import doc_blocks, figures, registry
from gspo_study.config import ConfigError
from gspo_study.paths import EXPERIMENTS
from gspo_study.study import figures as figure_specs

TOY = """
figure-99:
  title: "A toy figure"
  draw: analysis.figures.figure_1
  what: "the toy's line in docs/FIGURES.md"
  short: "the toy's README line"
  claims: []
  no_claim: "no claim: a toy"
  runs: [gspo, grpo_r2]
"""


def test_every_shipped_figure_resolves():
    found = registry.entries()
    assert sorted(found) == sorted(int(k.removeprefix("figure-")) for k in figure_specs())
    assert set(figures.FIGURES) == set(found)
    for n, entry in found.items():
        assert callable(figures.FIGURES[n]), n
        assert entry.short and entry.what and entry.title
        assert entry.claims or entry.no_claim or n == 4, f"figure {n}: neither REPORT rows nor a no_claim line"


def test_a_toy_figure_is_one_entry(tmp_path, monkeypatch):
    exp = tmp_path / "experiments"
    exp.mkdir()
    (exp / "figures.yaml").write_text((EXPERIMENTS / "figures.yaml").read_text() + TOY)
    assert list(registry.entries(exp))[-1] == 99 and len(registry.entries(exp)) == len(registry.entries()) + 1
    toy = registry.entries(exp)[99]
    assert toy.claims == () and toy.no_claim == "no claim: a toy"
    assert registry.Drawings(exp)[99] is figures.figure_1
    (exp / "figures.yaml").write_text(TOY)  # the docs' lines for the toy alone (the others read shipped results)
    monkeypatch.setattr(doc_blocks, "FIGURES", registry.entries(exp))
    readme = doc_blocks._results_lines(tmp_path, {})
    assert "| 99 | the toy's README line | no claim: a toy |" in readme
    detail = doc_blocks._results_table(tmp_path, {}, {})
    assert "| 99 | the toy's line in docs/FIGURES.md | no claim: a toy | – (no run yet) |" in detail


@pytest.mark.parametrize(
    "change, fragment",
    [
        (("  draw: analysis.figures.figure_1\n", ""), "figure-99 has no draw; allowed: a non-empty string each"),
        (("claims: []", "claims: [one]"), "figure-99's claims ['one']; allowed: a list of REPORT.md row numbers"),
    ],
)
def test_a_bad_entry_is_one_line(tmp_path, change, fragment):
    exp = tmp_path / "experiments"
    exp.mkdir()
    (exp / "figures.yaml").write_text(TOY.replace(*change))
    with pytest.raises(ConfigError) as err:
        registry.entries(exp)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_draw_path_naming_nothing_is_one_line():
    with pytest.raises(ConfigError, match=r"draw 'analysis.figures.figure_77' names no function"):
        registry.resolve("analysis.figures.figure_77")
    with pytest.raises(ConfigError, match=r"draw 'nowhere.at_all' names no function"):
        registry.resolve("nowhere.at_all")
