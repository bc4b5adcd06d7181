"""Documents from plain text, sentence splitting, and downloads with resume."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO

ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "prof", "st", "vs", "etc", "e.g", "i.e", "no", "fig",
                 "jr", "sr", "inc", "ltd", "co", "u.s", "approx"}
BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


MAX_SENTENCE_CHARS = 10_000


def _bounded(sentence: str) -> list[str]:
    """A "sentence" longer than MAX_SENTENCE_CHARS (a list, a table, text without stops) cut
    at spaces into pieces of at most that size: any sequence holds far less (512 tokens are
    about 2,500 characters), and tokenizing one megabyte-long line costs hundreds of MB."""
    pieces = []
    while len(sentence) > MAX_SENTENCE_CHARS:
        cut = sentence.rfind(" ", 0, MAX_SENTENCE_CHARS)
        cut = cut if cut > 0 else MAX_SENTENCE_CHARS
        pieces.append(sentence[:cut])
        sentence = sentence[cut:].lstrip()
    if sentence:
        pieces.append(sentence)
    return pieces


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph: split after . ! ? before a capital, except abbreviations;
    over-long ones cut (``_bounded``)."""
    sentences, start = [], 0
    for match in BOUNDARY.finditer(paragraph):
        candidate = paragraph[start:match.start()].strip()
        last_word = candidate.rsplit(" ", 1)[-1].rstrip(".").lower()
        if last_word in ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
            continue
        if candidate:
            sentences.extend(_bounded(candidate))
        start = match.end()
    tail = paragraph[start:].strip()
    if tail:
        sentences.extend(_bounded(tail))
    return sentences


TEXT_SUFFIXES = (".txt", ".txt.gz", ".txt.bz2", ".txt.xz")


def open_text(path: Path) -> IO[str]:
    """A text file, decompressed by its suffix (.gz, .bz2, .xz), read as UTF-8."""
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    if name.endswith(".bz2"):
        return bz2.open(path, "rt", encoding="utf-8", errors="replace")
    if name.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def is_wikipedia_dump(path: Path) -> bool:
    """A MediaWiki XML export (plain or compressed), told by its first bytes."""
    try:
        with open_text(path) as handle:
            head = handle.read(4096).lstrip()
    except (OSError, EOFError, lzma.LZMAError) as exc:
        raise ValueError(f"{path}: cannot be read ({exc})") from None
    return head.startswith("<mediawiki") or (head.startswith("<?xml") and "<mediawiki" in head)


def file_documents(path: Path) -> Iterator[list[str]]:
    """Documents of one text file: blocks separated by blank lines; each a list of lines."""
    current: list[str] = []
    with open_text(path) as handle:
        for line in handle:
            line = line.strip()
            if line:
                current.append(line)
            elif current:
                yield current
                current = []
    if current:
        yield current


def text_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.name.endswith(TEXT_SUFFIXES)
                  and p.is_file() and not p.name.startswith("."))


def text_documents(folder: Path) -> Iterator[list[str]]:
    """Documents from every text file of a folder (sorted): .txt, or .txt.gz/.bz2/.xz."""
    for path in text_files(folder):
        yield from file_documents(path)


def source_bytes(path: Path) -> int:
    """About how many bytes of text a source holds (compressed files counted 3x)."""
    files = text_files(path) if path.is_dir() else [path]
    total = 0
    for file in files:
        size = file.stat().st_size
        total += size * 3 if file.name.endswith((".gz", ".bz2", ".xz")) else size
    return total


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
