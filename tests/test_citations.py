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
        ["git", "ls-files", "*.py", "*.yaml", "*.toml", "*.tcss"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in out]


def _headings() -> set[str]:
    text = FACTS.read_text(encoding="utf-8")
    heads = set(re.findall(r"^## (F\d)\.", text, re.M))
    heads |= set(re.findall(r"^- \*\*([^*]+?)\.\*\*", text, re.M))  # principles: "- **Name.** text"
    heads |= set(re.findall(r"^## (.+)$", text, re.M))
    return heads


def test_facts_document_is_in_the_package() -> None:
    assert FACTS.is_file()
    heads = _headings()
    assert {f"F{i}" for i in range(1, 10)} <= heads, sorted(heads)


def test_every_citation_resolves() -> None:
    heads = _headings()
    missing: list[str] = []
    count = 0
    for path in _tracked_sources():
        if path.name == Path(__file__).name:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in re.finditer(r'facts\.md(?:\s+|\n\s*(?:#\s*)?)(F\d|"([^"]+)")', text):
            count += 1
            key = m.group(2) or m.group(1)
            if key not in heads:
                missing.append(f"{path.relative_to(ROOT)}: {m.group(0)!r}")
    assert count > 100  # the code does cite its facts
    assert not missing, missing


def test_nothing_cites_documents_outside_the_repository() -> None:
    pattern = re.compile(r"(FACTS|DESIGN)(\.md)? ?F?\d|\.\./shared|DESIGN \"|[Ii]ssue \d+\b")
    hits = []
    for path in _tracked_sources():
        if path.name == Path(__file__).name:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, hits
