"""The words the console uses that a user may not have are defined twice, in the README's "Words" section and
in the help screen's glossary (``?``): the same words in both (issue-26 item 17's fix, kept in step)."""

from __future__ import annotations

import re
from pathlib import Path

from calconsole.widgets.help import GLOSSARY

README = Path(__file__).resolve().parents[2] / "README.md"

#: each word as the help names it, and how the README's list names it
WORDS = {
    "calbin": "calbin", "C0 / C1 / C2 / C3": "C0 / C1 / C2 / C3", "S8 V-cache": "S8 V-cache",
    "facts.md F1..F10": "F1 ... F10", "job / device step": "job, device step", "fault xN": "fault xN",
    "pacing A/S": "pacing A/S", "timing-only": "timing-only",
}


def _readme_words() -> set[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("### Words", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- \*\*(.+?)\*\*", section, re.M))


def test_the_readme_and_the_help_define_the_same_words() -> None:
    helped = {k for k, _ in GLOSSARY}
    readme = _readme_words()
    for in_help, in_readme in WORDS.items():
        assert in_help in helped, (in_help, sorted(helped))
        assert in_readme in readme, (in_readme, sorted(readme))
    # nothing defined in one place only (the keys F1/F2/F3 are the help's own: the README says them beside F1..F10)
    assert helped - set(WORDS) == {"F1 / F2 / F3 (keys)"}, helped - set(WORDS)
    assert readme - set(WORDS.values()) == set(), readme - set(WORDS.values())


def test_the_help_states_the_default_numeric_limit_in_force() -> None:
    """The help's "timing-only" entry names the default numeric prompt limit: the one the simulator applies
    (``compose.NUMERIC_PROMPT_LIMIT``), not a figure of an earlier measurement."""
    from sim_backend.compose import NUMERIC_PROMPT_LIMIT

    entry = dict(GLOSSARY)["timing-only"]
    m = re.search(r"numeric limit \((\d+) by default", entry)
    assert m is not None, entry
    assert int(m.group(1)) == NUMERIC_PROMPT_LIMIT
    readme = README.read_text(encoding="utf-8")
    assert f"more\n    than **{NUMERIC_PROMPT_LIMIT}** new tokens" in readme
