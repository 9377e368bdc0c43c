"""README.md and docs/FIGURES.md quote the shipped study, never typed-in numbers: their marked blocks are what
analysis/doc_blocks.py writes from results/cpu (REPORT.json, the figure CSVs, the shipped runs' timings), README's
prose outside them holds no result number, and the README stays a five-minute read."""

from __future__ import annotations

import re

import pytest

from analysis import doc_blocks

README = doc_blocks.ROOT / "README.md"
NUMBER = re.compile(r"(?<![\w.])[−-]?\d+(?:\.\d+)?\s?(?:%|×)|(?<![\w.])[−-]?\d*\.\d+(?![\w.])")
ALLOWED = {"2507.18071", "95 %"}  # the paper's arXiv id; the intervals' level


def _prose(text: str) -> str:
    """`text` without its marked blocks, code fences and inline code (commands may hold numbers)."""
    text = doc_blocks.BLOCK.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`]*`", "", text)


@pytest.fixture(scope="module")
def found():
    return doc_blocks.blocks()


def test_blocks_are_what_the_shipped_results_say(found):
    assert doc_blocks.stale(found=found) == [], "run: python -m analysis.doc_blocks"
    for path in doc_blocks.DOCS:
        names = {m["name"] for m in doc_blocks.BLOCK.finditer(path.read_text())}
        assert names and names <= found.keys(), path


def _bumped(text: str, start: int = 0) -> str:
    """`text` with its first digit from `start` on changed (9 → 0, else + 1)."""
    at = start + re.search(r"\d", text[start:]).start()
    return text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :]


def test_a_changed_number_is_caught(found, tmp_path, monkeypatch):
    """`stale` (what `--check` and the test above run) names the document when one digit of a block differs from
    the results, whether the text was typed over or the results moved, and nothing while they agree."""
    text = README.read_text()
    block = next(m for m in doc_blocks.BLOCK.finditer(text) if re.search(r"\d", m["body"]))
    monkeypatch.setattr(doc_blocks, "ROOT", tmp_path)
    monkeypatch.setattr(doc_blocks, "DOCS", (tmp_path / "README.md",))
    (tmp_path / "README.md").write_text(text)
    assert doc_blocks.stale(found=found) == []
    assert doc_blocks.stale(found={**found, block["name"]: _bumped(found[block["name"]])}) == ["README.md"]
    (tmp_path / "README.md").write_text(_bumped(text, block.start("body")))
    assert doc_blocks.stale(found=found) == ["README.md"]
    with pytest.raises(KeyError, match="unknown block 'typo'"):
        doc_blocks.rewrite("<!-- BEGIN typo -->\nx\n<!-- END typo -->", found)


def test_readme_prose_holds_no_result_number():
    numbers = set(NUMBER.findall(_prose(README.read_text()))) - ALLOWED
    assert not numbers, f"numbers typed into README.md outside its written blocks: {sorted(numbers)}"


def test_readme_is_a_five_minute_read():
    text = README.read_text()
    prose = _prose(text)
    words = len(re.findall(r"\w+", doc_blocks.BLOCK.sub("", text)))
    assert len(text.splitlines()) <= 150 and words <= 1500, (len(text.splitlines()), words)
    running = "\n".join(ln for ln in prose.splitlines() if not ln.startswith(("|", "#")))  # tables, headings
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", running)) if s.strip()]
    assert max(len(s.split()) for s in sentences) <= 60
    assert not re.search(r"issue \d+|part \([a-z]\)|this machine", text)


def test_frontier_lines_quote_the_frontier_section():
    """Figures 13–15's lines are written from FRONTIER.json: collapsed counts per dose in the plan's arm order, and
    the decisive stage's paired Δ at the dose the REPORT recomputed, with its half-width and reading."""
    arm = lambda axis, dose, a, k, n: dict(axis=axis, dose=dose, arm=a, collapsed=k, runs=n)  # noqa: E731
    records = {
        "summary": [
            arm("V", 1.0, "gspo", 0, 8),
            arm("V", 1.0, "grpo", 1, 8),
            arm("V", 1.0, "grpo_r2", 0, 8),
            arm("V", 300.0, "grpo", 8, 8),
            arm("V", 300.0, "grpo_r2", 2, 8),
            arm("V", 300.0, "gspo", 0, 8),
            arm("positive", 0.001, "grpo", 2, 2),
        ],
        "comparisons": [
            dict(axis="V", dose=300.0, arm="grpo_r2", delta=0.4, lo=0.3, hi=0.5, n=8, reading="difference")
        ],
        "decisive_doses": {"V": 300.0, "M": None},
    }
    v = doc_blocks._frontier_line(13, records)
    assert "(GRPO (no replay) / GRPO + R2 / GSPO): 1: 1/8 0/8 0/8; 300: 8/8 2/8 0/8" in v and "0.001: 2/2" in v
    d = doc_blocks._frontier_line(15, records)
    assert d.startswith("axis V at 300: collapsed GRPO (no replay) 8/8, GRPO + R2 2/8, GSPO 0/8")
    assert "GRPO + R2 − GRPO 0.4 ±0.1 (n=8) → difference" in d and "axis M" not in d


def test_findings_state_the_frontier_at_its_decisive_doses():
    """The findings block's frontier sentence is FRONTIER.json's: per axis with a decisive dose, GRPO without replay's
    and the remedy's collapsed counts and the remedy's paired Δ with its reading; nothing before the doses exist."""
    at = dict(drift_first=0.2, drift_per_update=0.1, flips_per_layer=0.2, k3=0.03)
    records = {
        "summary": [
            dict(axis="V", dose=300.0, arm="grpo", collapsed=7, runs=8, **at),
            dict(axis="V", dose=300.0, arm="grpo_r2", collapsed=1, runs=8, **at),
            dict(axis="M", dose=0.3, arm="grpo", collapsed=0, runs=8, **at),
        ],
        "comparisons": [
            dict(axis="V", dose=300.0, arm="grpo_r2", delta=0.4, lo=0.3, hi=0.5, n=8, reading="difference")
        ],
        "decisive_doses": {"V": 300.0, "M": 0.3},
    }
    text = doc_blocks._frontier_finding(records)
    assert "Router lr ×300 moved 20 % of routing choices in the first update" in text
    assert "GRPO without replay collapsed in 7 of 8 runs, GRPO + R2 in 1 of 8" in text
    assert "Δ final pass@1 0.4 ±0.1 → difference" in text and text.count("\n") == 1  # one short sentence per axis
    assert "noise" not in text  # axis M has no remedy run and no comparison yet: no claim about it
    assert doc_blocks._frontier_finding({**records, "decisive_doses": {}}) == doc_blocks._frontier_finding({}) == ""


def _prose_sentences(text: str) -> list[str]:
    """The README's sentences, generated blocks included: code, tables, headings and markers left out."""
    import re

    text = re.sub(r"<!--.*?-->", "", re.sub(r"```.*?```", "", text, flags=re.S))
    paragraphs, current = [], []
    for line in text.splitlines():
        if not line.strip() or line.startswith(("|", "#", "![")):
            paragraphs += [" ".join(current)] if current else []
            current = []
        else:
            current.append(line.strip())
    paragraphs += [" ".join(current)] if current else []
    return [s for p in paragraphs for s in re.split(r"(?<=[.!?])\s+(?=[A-Z`*(\[])", p)]


def test_the_readme_keeps_its_budget_counting_what_its_blocks_print():
    """Issue 67: at most 1,500 words with the generated blocks, every prose sentence at most 40 words (one findings
    sentence once ran to 117)."""
    text = (doc_blocks.ROOT / "README.md").read_text()
    assert len(text.split()) <= 1500, len(text.split())
    long = [s for s in _prose_sentences(text) if len(s.split()) > 40]
    assert not long, long[0][:200]
    assert max(len(s.split()) for s in _prose_sentences("A " + "word " * 50 + "end. Short one.")) == 52  # it counts
    assert len(_prose_sentences("| a. B. C. |\n\n## Head. Er.\n\nOne. Two.")) == 2  # tables and headings apart
