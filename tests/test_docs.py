"""The front page and the manual hold together: README's results table (and docs/results.md's) is what
benchmarks/results_table.py renders from the figures in benchmarks/results/, README stays a front page (210 lines at
most), and every link inside the repository from README.md, docs/*.md, benchmarks/README.md and CHANGELOG.md reaches
a file, and a heading where it names one (GitHub's anchors)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import results_table  # noqa: E402

PAGES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "benchmarks" / "README.md",
    REPO / "CHANGELOG.md",
]
LINK = re.compile(r"!?\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def unfenced(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def prose(text: str) -> str:
    """``text`` without code, fenced or inline, where a bracket is not a link."""
    return re.sub(r"`[^`\n]*`", "``", unfenced(text))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives ``path``'s headings: lowercase, spaces to hyphens, other punctuation than hyphens
    and underscores dropped; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in unfenced(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"<[^>]+>", "", m.group(1)).replace("`", "")
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        where = f"{page.relative_to(REPO)}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif REPO.resolve() not in (dest, *dest.parents):
            broken.append(f"{where} (outside the repository)")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_readme_results_table_is_rendered_from_the_results_files():
    readme = (REPO / "README.md").read_text()
    assert results_table.block_of(readme) == results_table.render(readme=True), (
        "README's results table differs from benchmarks/results/: run python benchmarks/results_table.py --write"
    )


def test_docs_results_table_is_rendered_from_the_results_files():
    page = (REPO / "docs" / "results.md").read_text()
    assert results_table.block_of(page) == results_table.render(readme=False), (
        "docs/results.md's table differs from benchmarks/results/: run python benchmarks/results_table.py --write"
    )


def test_every_results_section_names_its_data_file_or_says_it_has_none():
    """Each section of docs/results.md names a data file under benchmarks/results/ (or holds the rendered table), or
    says that no data file holds its figures; a section that does neither is a figure without its run."""
    import re

    sections = re.split(r"^#{2,3} ", (REPO / "docs" / "results.md").read_text(), flags=re.M)[1:]
    assert len(sections) >= 10
    for section in sections:
        named = "benchmarks/results/" in section or "results:begin" in section
        says = "No data file holds this section's figures" in section or "*Data: in each subsection below.*" in section
        assert named or says, f"docs/results.md, section {section.splitlines()[0]!r}: name its data file or say none"
        for ref in re.findall(r"benchmarks/results/([\w./-]+\.json)", section):
            assert (REPO / "benchmarks" / "results" / ref).is_file(), f"{ref} named in docs/results.md does not exist"


def test_every_results_file_is_complete():
    files = [p for p in sorted(results_table.RESULTS.glob("*.json")) if results_table.SCHEMA in p.read_text()]
    assert files, "no results files in benchmarks/results/"
    rows = results_table.load()
    assert {r["file"] for r in rows} == {p.name for p in files}
    for r in rows:
        where = f"{r['file']}: {r['recipe']}, {r['setting']}"
        n = len(r["seeds"])
        assert len(r["accuracy_pct"]) == n, where
        assert (r.get("wall_s") and len(r["wall_s"]) == n) or len(r.get("wall_s_range") or []) == 2, where
        assert len(r.get("shared_machine") or [False] * n) == n, where
        assert r["data"] and r["command"] and r["machine"]["cpu_flags"], where
    assert any(r["readme"] for r in rows)


def test_the_mean_is_rounded_half_up_from_the_seeds():
    assert results_table.mean_pct([99.42, 99.28, 99.42, 99.40, 99.57]) == "99.42"
    assert results_table.mean_pct([1.00, 1.01]) == "1.01"  # 1.005


def test_replace_block_keeps_what_is_around_the_markers(tmp_path):
    text = f"a\n{results_table.BEGIN}\nold\n{results_table.END}\nb\n"
    assert results_table.replace_block(text, "new") == f"a\n{results_table.BEGIN}\nnew\n{results_table.END}\nb\n"
    with pytest.raises(ValueError):
        results_table.replace_block("no markers", "new")


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 210, f"README.md has {len(lines)} lines; move the depth into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_inside_the_repository_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_sees_a_broken_file_and_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "b.md").write_text("# A heading, with `code`!\n\n## Repeated\n\n## Repeated\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#a-heading-with-code) [ok](b.md#repeated-1) [ok](#top) [ext](https://x.org/a#b)\n"
        "`[not a link](nowhere.md)`\n\n# Top\n\n[bad](b.md#missing) [gone](c.md)\n"
    )
    assert broken_links(page) == ["a.md: b.md#missing (no heading with that anchor)", "a.md: c.md (no such file)"]


def test_readme_api_paragraph_is_common_api_all():
    """README's API paragraph names exactly the public surface the recipes import from."""
    import common.api

    text = (REPO / "README.md").read_text()
    paragraph = next(p for p in text.split("\n\n") if p.startswith("The API:"))
    named = re.findall(r"`(\w+)`", paragraph.split(":", 2)[2])
    assert named == list(common.api.__all__)
