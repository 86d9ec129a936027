"""README renders as written: every table starts with a header and its separator row, so no table is cut in two by
a blank line (rows after it would show as raw pipes)."""

from __future__ import annotations

import re

from helpers import REPO

SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def test_every_readme_table_starts_with_a_header_and_a_separator():
    lines, fenced, broken = (REPO / "README.md").read_text().splitlines(), False, []
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        starts_table = line.startswith("|") and (i == 0 or not lines[i - 1].strip())
        if not fenced and starts_table and not (i + 1 < len(lines) and SEPARATOR.match(lines[i + 1])):
            broken.append(f"README.md:{i + 1}: {line[:80]}")
    assert not broken, "a table row with no header above it (a blank line inside a table?):\n" + "\n".join(broken)
