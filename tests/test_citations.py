"""Every citation of the facts in code, YAML and tests resolves inside the repository.

The facts the simulator depends on live in ``sim_backend/facts.md`` (figures F1-F9 with the report's
section, then the design principles the code cites by name). A comment that cites ``facts.md F7`` or
``facts.md "What-if is labelled"`` must find that heading there; nothing may point outside the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTS = ROOT / "sim_backend" / "facts.md"


def _tracked_sources() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py", "*.yaml", "*.toml", "*.tcss", "*.md"], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout.split()
    return [ROOT / p for p in out]


def _headings() -> set[str]:
    text = FACTS.read_text(encoding="utf-8")
    heads = set(re.findall(r"^## (F\d+)\.", text, re.M))
    heads |= set(re.findall(r"^- \*\*([^*]+?)\.\*\*", text, re.M))  # principles: "- **Name.** text"
    heads |= set(re.findall(r"^## (.+)$", text, re.M))
    return heads


def test_facts_document_is_in_the_package() -> None:
    assert FACTS.is_file()
    heads = _headings()
    assert {f"F{i}" for i in range(1, 11)} <= heads, sorted(heads)


def test_every_citation_resolves() -> None:
    heads = _headings()
    missing: list[str] = []
    count = 0
    for path in _tracked_sources():
        if path.name in (Path(__file__).name, FACTS.name):  # facts.md says how to cite it, with a placeholder
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r'facts\.md(?:\s+|\n\s*(?:#\s*)?)(F\d+\b|"([^"]+)")', text):
            count += 1
            key = m.group(2) or m.group(1)
            if key not in heads:
                missing.append(f"{path.relative_to(ROOT)}: {m.group(0)!r}")
    assert count > 100  # the code does cite its facts
    assert not missing, missing


def test_nothing_cites_documents_outside_the_repository() -> None:
    """No citation of the design or facts documents of the team (not in the repository), of an issue, or of
    the source report's sections directly (``report §N``: the report is not in the repository; facts.md
    carries what the code needs of it, under its own headings, and says which section each came from)."""
    pattern = re.compile(r"(FACTS|DESIGN)(\.md)? ?F?\d|\.\./shared|DESIGN(\.md)? \"|[Ii]ssue \d+\b")
    bare_section = re.compile(r"report §")  # allowed beside the facts.md figure that carries it
    cited = re.compile(r"facts\.md F\d+|\bF\d+\b")
    hits = []
    for path in _tracked_sources():
        if path.name in (Path(__file__).name, FACTS.name):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if pattern.search(line) or (bare_section.search(line) and not cited.search(line)
                                        and "re.search" not in line):  # a test that looks for such text
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, hits
