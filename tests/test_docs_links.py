"""Every page under docs/ is reachable from README.md, and every relative link leads somewhere.

The walk starts at README.md and follows each relative Markdown link (``[text](target)``, images
included) into the pages it reaches; links inside fenced code blocks are not links, anchors
(``page.md#part``) are ignored, and links with a scheme (``https:``, ``mailto:``) are left alone.
Data files (JSON, pictures) live in docs/data/, beside the pages.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def links(page: Path) -> list[str]:
    """The link targets of ``page`` outside code: fenced blocks and inline code spans dropped."""
    text = _FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return _LINK.findall(text)


def walk(start: Path, root: Path = ROOT) -> tuple[set[Path], list[tuple[str, str]]]:
    """The Markdown pages reachable from ``start``, and the (page, target) links that lead nowhere."""
    seen: set[Path] = set()
    broken: list[tuple[str, str]] = []
    todo = [start.resolve()]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in links(page):
            if _SCHEME.match(target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            found = (page.parent / path).resolve()
            if not found.exists():
                broken.append((page.relative_to(root.resolve()).as_posix(), target))
            elif found.suffix == ".md" and found.is_file():
                todo.append(found)
    return seen, broken


def test_every_relative_link_leads_somewhere() -> None:
    _, broken = walk(ROOT / "README.md")
    assert not broken, f"links to nothing: {broken}"


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached, _ = walk(ROOT / "README.md")
    pages = sorted(DOCS.rglob("*.md"))
    assert len(pages) >= 15
    unreached = [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in reached]
    assert not unreached, f"pages no link from README.md reaches: {unreached}"


def test_docs_holds_pages_and_its_data_lives_in_one_folder() -> None:
    """docs/ holds pages (and docs/examples/ more of them); JSON, pictures and logs sit in docs/data/."""
    strays = [
        str(p.relative_to(ROOT))
        for p in sorted(DOCS.rglob("*"))
        if p.is_file() and p.suffix != ".md" and DOCS / "data" not in p.parents
    ]
    assert not strays, f"data files outside docs/data/: {strays}"
    assert not list((DOCS / "data").rglob("*.md")), "docs/data/ holds data, not pages"


def test_the_walk_sees_what_a_link_is(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "[b](b.md#part) ![pic](data/p.png) [web](https://example.com) [here](#top)\n"
        "```\n[not a link](missing.md)\n```\n`[nor this](gone.md)` [gone](c.md)\n"
    )
    (tmp_path / "b.md").write_text("[back](a.md)\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.png").write_bytes(b"")
    seen, broken = walk(tmp_path / "a.md", root=tmp_path)
    assert seen == {(tmp_path / "a.md").resolve(), (tmp_path / "b.md").resolve()}
    assert broken == [("a.md", "c.md")]
