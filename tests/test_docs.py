"""The docs stay true to the code and quick to read: docs/ARCHITECTURE.md's one module table names every module of
gspo_study in its import layer (pyproject.toml's import-linter contract), and every doc but the journal keeps the
README's sentence-length rule (no sentence over 60 words outside tables, headings and code)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
BLOCK = re.compile(r"<!-- BEGIN (?P<name>[\w-]+) -->\n.*?<!-- END (?P=name) -->", re.S)  # written, not typed
MAX_WORDS = 60


def _tables(text: str) -> list[list[list[str]]]:
    """Every markdown table: its rows (header first, the --- row left out), each a list of cells."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                current.append([c.strip() for c in line.strip("|").split(" | ")])
        elif current:
            tables.append(current)
            current = []
    return tables


def _layers() -> list[set[str]]:
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    return [{m.strip().removeprefix("gspo_study.") for m in layer.split("|")} for layer in contract["layers"]]


def test_one_module_table_true_to_the_code():
    tables = [t for t in _tables(ARCHITECTURE.read_text()) if "modules" in t[0] or t[0][0] in ("where", "module")]
    assert len(tables) == 1, "docs/ARCHITECTURE.md: one table of modules"
    rows = tables[0][1:]
    named = [{m.rstrip("/") for m in re.findall(r"`([\w/]+)`", row[1])} - {"__main__"} for row in rows]
    assert named == _layers(), "the table's rows are not pyproject.toml's import layers, in order"
    package = ROOT / "gspo_study"
    modules = {p.stem for p in package.glob("*.py")} | {p.parent.name for p in package.glob("*/__init__.py")}
    assert set().union(*named) == modules - {"__init__", "__main__"}
    for row in rows:  # and every module of a subpackage, in its row
        for pkg in re.findall(r"`(\w+)/`", row[1]):
            subs = {p.stem for p in (package / pkg).glob("*.py")} - {"__init__"}
            assert subs <= set(re.findall(r"`(\w+)`", row[2])), (pkg, subs - set(re.findall(r"`(\w+)`", row[2])))


def sentences(text: str) -> list[str]:
    """The running prose of a markdown text, split into sentences: written blocks, code, tables and headings out."""
    text = re.sub(r"```.*?```", "", BLOCK.sub("", text), flags=re.S)
    text = re.sub(r"`[^`]*`", "", text)
    running = "\n".join(ln for ln in text.splitlines() if not ln.startswith(("|", "#")))
    chunks = re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", running)  # paragraphs and list items end a sentence
    return [s for c in chunks for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", c).strip()) if s.strip()]


def test_every_doc_but_the_journal_keeps_sentences_short():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    long = {
        str(p.relative_to(ROOT)): [s[:80] for s in sentences(p.read_text()) if len(s.split()) > MAX_WORDS]
        for p in docs
        if not p.name.startswith("LOG")
    }
    assert not any(long.values()), {k: v for k, v in long.items() if v}


def test_the_rule_can_fail():
    assert max(len(s.split()) for s in sentences("word " * 61 + ".")) > MAX_WORDS
    assert sentences("| a | " + "word " * 80 + "|\n# " + "word " * 80) == []
    assert len(sentences("a list:\n- one item\n- another\n\nA paragraph")) == 4
