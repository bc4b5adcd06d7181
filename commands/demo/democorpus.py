"""An English corpus from what every Debian machine holds: license texts and package docs.

Files under /usr/share/common-licenses and /usr/share/doc (gzip-compressed ones too) that
read as prose become one document each: paragraphs joined onto single lines, a blank line
between documents (the format ``bert_trainer.dataset prepare`` reads).  When the machine holds
less than asked, the documents are written again until the size is reached (the sizes a
bench needs, not new text: ``distinct_bytes`` says how much is new).  bench/bench_dataset.py
reads all of it; the demo reads five license texts (``LICENSES``), a corpus small enough for
a 2-layer BERT to learn in a few CPU minutes (its loss halves in 1,200 steps; on all of
/usr/share/doc it plateaus near 6 of 8.3).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path

SOURCES = (Path("/usr/share/common-licenses"), Path("/usr/share/doc"))
# In base-files: on every Debian machine.  About 43 KB of distinct legal English.
LICENSES = tuple(Path("/usr/share/common-licenses") / name
                 for name in ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "MPL-2.0"))
WORDY = re.compile(r"[A-Za-z]+")


def _prose(text: str) -> list[str]:
    """Paragraphs of running text, or nothing when the file is markup, code or tables."""
    if "<html" in text[:2000].lower() or "\x00" in text:
        return []
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        words = WORDY.findall(block)
        if len(words) < 8 or sum(map(len, words)) < 0.6 * len(block.replace(" ", "")):
            continue
        paragraphs.append(" ".join(block.split()))
    return paragraphs


def _files(sources: tuple[Path, ...]) -> Iterator[Path]:
    for source in sources:
        yield from sorted(source.rglob("*")) if source.is_dir() else [source]


def documents(sources: tuple[Path, ...] = SOURCES) -> Iterator[tuple[str, list[str]]]:
    seen: set[int] = set()
    for path in _files(sources):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" \
                else path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError, EOFError):
            continue
        paragraphs = _prose(text)
        key = hash(tuple(paragraphs))
        if paragraphs and key not in seen:  # the same license text in many packages
            seen.add(key)
            yield str(path), paragraphs


def assemble(folder: Path, megabytes: float, sources: tuple[Path, ...] = SOURCES
             ) -> dict[str, int]:
    """Write about ``megabytes`` of text into ``folder`` as part_NNNN.txt; returns sizes."""
    folder.mkdir(parents=True, exist_ok=True)
    wanted = int(megabytes * 1e6)
    distinct = list(documents(sources))
    if not distinct:
        raise SystemExit("error: no prose found in " + ", ".join(map(str, sources)))
    written = distinct_bytes = part = 0
    handle = None
    rounds = 0
    while written < wanted:
        for _name, paragraphs in distinct:
            if handle is None or handle.tell() > 1_000_000:
                if handle:
                    handle.close()
                handle = open(folder / f"part_{part:04d}.txt", "w", encoding="utf-8")
                part += 1
            block = "\n".join(paragraphs) + "\n\n"
            handle.write(block)
            size = len(block.encode())
            written += size
            distinct_bytes += size if rounds == 0 else 0
            if written >= wanted:
                break
        rounds += 1
    if handle:
        handle.close()
    return {"bytes": written, "distinct_bytes": distinct_bytes, "files": part,
            "documents_distinct": len(distinct)}
