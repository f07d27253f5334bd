"""The product cites only what it ships: every `docs/<page>.md §N` in the code, configs, scripts and docs names
a page of docs/ and one of its numbered sections, and nothing points at documents outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
CITATION = re.compile(r"docs/([a-z_]+\.md)(?:,? ?§(\d+)(?:-(\d+))?)?")
OUTSIDE = re.compile(
    "|".join(["SCALERL" + r"\.md", "DESIGN" + r"\.md", "FINDINGS" + r"\.md", "STYLE" + r"\.md", r"\.\./shared/"])
)


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    suffixes = {".py", ".md", ".yaml", ".sh", ".toml", ".def", ""}
    return [ROOT / n for n in names if Path(n).suffix in suffixes and (ROOT / n).is_file()]


def _sections(page: Path) -> set[int]:
    return {int(m) for m in re.findall(r"^## (\d+)\.", page.read_text(), re.MULTILINE)}


def test_every_docs_citation_names_a_page_and_section_that_exist():
    wrong = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        for match in CITATION.finditer(text):
            page = ROOT / "docs" / match.group(1)
            if not page.is_file():
                wrong.append(f"{path.relative_to(ROOT)}: {match.group(0)} (no such page)")
                continue
            first, last = match.group(2), match.group(3) or match.group(2)
            if first and not set(range(int(first), int(last) + 1)) <= _sections(page):
                wrong.append(f"{path.relative_to(ROOT)}: {match.group(0)} (sections: {sorted(_sections(page))})")
    assert not wrong, "citations of docs that do not exist:\n" + "\n".join(wrong)


def test_nothing_cites_documents_outside_the_repository():
    cited = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _tracked_text_files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not cited, "references to documents the product does not ship:\n" + "\n".join(cited)


def test_the_citation_check_sees_a_wrong_section():
    assert CITATION.search("see docs/recipe.md §2-6").groups() == ("recipe.md", "2", "6")
    assert 19 not in _sections(ROOT / "docs" / "recipe.md") and {1, 9} <= _sections(ROOT / "docs" / "recipe.md")
