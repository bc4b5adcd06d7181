"""The newcomer's page and the documentation site: the README stays a page, and docs/ builds
with MkDocs' strict mode (a broken link or a page left out of the navigation fails)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_is_a_page_that_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, len(lines)
    assert lines[2:6] == ["```sh", lines[3], lines[4], "```"]
    assert lines[3].startswith("./setup.sh demo ") and lines[4].startswith("./setup.sh test ")
    for line in lines:  # every page it sends a reader to is there
        for target in (part.split(")")[0] for part in line.split("](")[1:]):
            assert (ROOT / target).is_file(), target


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    pages = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")}
    assert {"threat-model", "images", "trainer", "squashfs"} <= pages


def test_every_attack_test_quotes_a_line_of_the_threat_model() -> None:
    """docs/threat-model.md's "Who reads and writes what": each test that plays a line quotes
    it (`threat-model: "..."` in its docstring), and every quote is a line of that page; each
    surface's reads, writes and availability are played at least once."""
    import re

    page = " ".join((ROOT / "docs" / "threat-model.md").read_text().split())
    quotes = []
    for name in ("test_tenants_third.py", "test_blob_cache.py", "test_audit.py"):
        text = (ROOT / "tests" / "e2e" / name).read_text()
        quotes += re.findall(r'threat-model: "([^"]+)"', " ".join(text.split()))
    assert len(quotes) >= 8, quotes
    for quote in quotes:
        assert quote in page, f"tests quote {quote!r}, which docs/threat-model.md does not say"
