"""Every `docs/*.md` a source file, test, benchmark or document cites exists in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_cited_doc_exists():
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")]
    for folder in ("src", "tests", "benchmarks"):
        files += (ROOT / folder).rglob("*.py")
    cited = {(f, m) for f in files for m in re.findall(r"docs/[\w.-]+\.md", f.read_text(encoding="utf-8"))}
    assert cited, "no citation found: the pattern is wrong"
    missing = sorted(f"{f.relative_to(ROOT)} cites {m}" for f, m in cited if not (ROOT / m).is_file())
    assert not missing, missing
