"""Every relative link of the README, docs/ and the results page leads somewhere."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without fenced or indented code blocks and inline code, where a bracket is not a link."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path):
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"(?m)^#+\s+(.*?)\s*$", prose(page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        yield slug if n == 0 else f"{slug}-{n}"


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in set(anchors(dest)):
            bad.append(f"{target}: no such heading")
    return bad


def test_pages_exist():
    assert len(PAGES) >= 9, [p.name for p in PAGES]
    assert all(p.is_file() for p in PAGES)


def test_every_relative_link_resolves():
    bad = {str(p.relative_to(ROOT)): broken_links(p) for p in PAGES}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}


def test_the_docs_link_the_results_page_not_its_folders():
    """A figure lives on the results page (bench/README.md), which names the folder behind it;
    the README and docs/ link the page's headings, so a re-measured table moves one link."""
    dated = {str(p.relative_to(ROOT)): [t for t in LINK.findall(prose(p.read_text())) if "bench/results/" in t]
             for p in PAGES if p.parent != ROOT / "bench"}
    assert not any(dated.values()), {k: v for k, v in dated.items() if v}


def test_the_checker_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    page.write_text("[ok](there.md) [anchor](there.md#a-heading) [gone](missing.md) "
                    "[bad anchor](there.md#nope) `[code](x.md)`\n\n    [indented](y.md)\n")
    assert broken_links(page) == ["missing.md: no such file", "there.md#nope: no such heading"]
