"""Every relative link in README.md and docs/*.md resolves to a file in the repository, and none leaves it.

Two forms are read: Markdown links `[text](target)`, resolved from the linking file's folder as GitHub does, and
paths written in the prose (`docs/cpu.md`, `bench/gpu.py`), resolved from the repository root as the docs write
them; a path that starts with `../` leaves the repository whatever it names. A prose path to a file that is gone
passes when the words after it on its line say in which commit (`deleted in 82403e3`). Controls: a planted link out of the
repository, to a missing file, and a prose path of either kind are each reported; good links are not."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A prose path: `../` steps or a top-level folder of the tree, then a file name with one of these extensions.
PROSE_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*\w|(?:[\w-]+/)+[\w.-]+\.(?:md|py|c|h|ipynb|toml))(?![\w/])")
PLACEHOLDER = re.compile(r"(^|/)[A-Z_]+(\.|/|$)")   # docs' stand-ins such as kernels/NAME.py
DELETED = re.compile(r"deleted in [0-9a-f]{7,40}\b")


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _resolves_inside(root: Path, target: Path) -> str | None:
    """Why target is not a file of the repository at root, or None."""
    target = target.resolve()
    if not target.is_relative_to(root.resolve()):
        return "leaves the repository"
    return None if target.exists() else "names no file"


def broken_links(root: Path) -> list[str]:
    """`file:line: target (why)` for each relative link or prose path of the docs that does not resolve."""
    tops = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    bad = []
    for f in doc_files(root):
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            found = []
            for m in MD_LINK.finditer(line):
                target = m.group(1).split("#", 1)[0]
                if target and not re.match(r"[a-z][a-z0-9+.-]*:", target):   # skip URLs and bare anchors
                    found.append((m.group(1), f.parent / target))
            for m in PROSE_PATH.finditer(MD_LINK.sub("", line)):
                path = m.group(1)
                gone = DELETED.search(line, m.end(), m.end() + 120) and not path.startswith("../")
                if path.startswith("../") or (path.split("/", 1)[0] in tops and not PLACEHOLDER.search(path)
                                              and not gone):
                    found.append((path, root / path))
            for text, target in found:
                why = _resolves_inside(root, target)
                if why:
                    bad.append(f"{f.relative_to(root)}:{n}: {text} ({why})")
    return bad


def test_every_relative_link_of_the_docs_resolves_inside_the_repository():
    assert broken_links(ROOT) == [], "fix or remove these links (a file outside the repository: say what it is)"


def test_planted_bad_links_are_reported(tmp_path):
    """Control: links out of the repository or to missing files, in either form, are each found."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "bench").mkdir()
    (root / "bench" / "gpu.py").write_text("")
    (root / "docs" / "cpu.md").write_text("[readme](../README.md), `bench/gpu.py`, kernels/NAME.py\n")
    (tmp_path / "DESIGN.md").write_text("")
    (root / "README.md").write_text(
        "[cpu](docs/cpu.md) and [site](https://example.com) and [here](#quick-start)\n"
        "[design](../DESIGN.md)\n"
        "[gone](docs/gone.md#part)\n"
        "`../shared/DESIGN.md` has the architecture\n"
        "see docs/missing.md and bench/gone.py\n"
        "`bench/old.py --flag` (deleted in 82403e3) and `bench/gone.py`, deleted in the end\n")
    assert broken_links(root) == [
        "README.md:2: ../DESIGN.md (leaves the repository)",
        "README.md:3: docs/gone.md#part (names no file)",
        "README.md:4: ../shared/DESIGN.md (leaves the repository)",
        "README.md:5: docs/missing.md (names no file)",
        "README.md:5: bench/gone.py (names no file)",
        "README.md:6: bench/gone.py (names no file)",
    ]
