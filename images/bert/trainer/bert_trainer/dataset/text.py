"""Documents from plain text, sentence splitting, and downloads with resume."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "st", "vs", "etc", "e.g", "i.e", "no", "fig",
                 "jr", "sr", "inc", "ltd", "co", "u.s", "approx"}
BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph: split after . ! ? before a capital, except abbreviations."""
    sentences, start = [], 0
    for match in BOUNDARY.finditer(paragraph):
        candidate = paragraph[start:match.start()].strip()
        last_word = candidate.rsplit(" ", 1)[-1].rstrip(".").lower()
        if last_word in ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
            continue
        if candidate:
            sentences.append(candidate)
        start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def text_documents(folder: Path) -> Iterator[list[str]]:
    """Documents from every .txt file (sorted), separated by blank lines; each a list of lines."""
    for path in sorted(folder.rglob("*.txt")):
        current: list[str] = []
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                line = line.strip()
                if line:
                    current.append(line)
                elif current:
                    yield current
                    current = []
        if current:
            yield current


def download(url: str, dest: Path, chunk: int = 1 << 20) -> Path:
    """Fetch ``url`` into ``dest``, resuming a partial ``dest.part`` with a Range request."""
    import requests

    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with requests.get(url, headers=headers, stream=True, timeout=(10, 120)) as response:
        if response.status_code == 416:  # already complete
            os.replace(part, dest)
            return dest
        response.raise_for_status()
        mode = "ab" if have and response.status_code == 206 else "wb"
        with open(part, mode) as out:
            for block in response.iter_content(chunk):
                out.write(block)
    os.replace(part, dest)
    return dest
