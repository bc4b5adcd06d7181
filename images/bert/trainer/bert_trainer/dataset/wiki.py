"""Streaming article extraction from a Wikipedia XML dump (``.bz2`` or plain).

Only main-namespace articles that are not redirects are kept.  Markup is
removed: comments, references, templates (nested), tables (nested), files,
images and categories, HTML tags, headings, list lines; internal and external
links keep their text.  Each article becomes one document of paragraphs.
"""

from __future__ import annotations

import bz2
import html
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

COMMENT = re.compile(r"<!--.*?-->", re.S)
REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
TAG = re.compile(r"</?[a-zA-Z][^>]*>")
FILE_LINK = re.compile(r"\[\[(?:File|Image|Category|Datei|Fichier):", re.I)
LINK = re.compile(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]")
EXTERNAL = re.compile(r"\[(?:https?|ftp)://\S+\s*([^\]]*)\]")
QUOTES = re.compile(r"'{2,5}")
HEADING = re.compile(r"^=+.*=+\s*$")
LIST_LINE = re.compile(r"^[*#:;]")
SPACES = re.compile(r"[ \t]+")


def _strip_balanced(text: str, opener: str, closer: str) -> str:
    """Remove every (nested) ``opener … closer`` span."""
    out, depth, index = [], 0, 0
    while index < len(text):
        if text.startswith(opener, index):
            depth += 1
            index += len(opener)
        elif depth and text.startswith(closer, index):
            depth -= 1
            index += len(closer)
        else:
            if depth == 0:
                out.append(text[index])
            index += 1
    return "".join(out)


def _strip_file_links(text: str) -> str:
    while match := FILE_LINK.search(text):
        depth, index = 0, match.start()
        while index < len(text):
            if text.startswith("[[", index):
                depth += 1
                index += 2
            elif text.startswith("]]", index):
                depth -= 1
                index += 2
                if depth == 0:
                    break
            else:
                index += 1
        text = text[: match.start()] + text[index:]
    return text


def clean_wikitext(text: str) -> list[str]:
    """Paragraphs of plain text from wiki markup."""
    text = COMMENT.sub("", text)
    text = REF.sub("", text)
    text = _strip_balanced(text, "{{", "}}")
    text = _strip_balanced(text, "{|", "|}")
    text = _strip_file_links(text)
    text = LINK.sub(r"\1", text)
    text = EXTERNAL.sub(r"\1", text)
    text = TAG.sub("", text)
    text = QUOTES.sub("", text)
    text = html.unescape(text).replace("\xa0", " ")
    paragraphs, current = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line or HEADING.match(line) or LIST_LINE.match(line):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(SPACES.sub(" ", line))
    if current:
        paragraphs.append(" ".join(current))
    return [p for p in paragraphs if len(p) > 1]


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def articles(path: Path) -> Iterator[tuple[str, list[str]]]:
    """(title, paragraphs) of every article in the dump, streamed."""
    opener = bz2.open if path.suffix == ".bz2" else open
    with opener(path, "rb") as handle:
        title, namespace, redirect, body = "", "0", False, ""
        for event, element in ET.iterparse(handle, events=("end",)):
            name = _local(element.tag)
            if name == "title":
                title = element.text or ""
            elif name == "ns":
                namespace = (element.text or "").strip()
            elif name == "redirect":
                redirect = True
            elif name == "text":
                body = element.text or ""
            elif name == "page":
                if namespace == "0" and not redirect and not body.lstrip().lower().startswith(
                        "#redirect"):
                    paragraphs = clean_wikitext(body)
                    if paragraphs:
                        yield title, paragraphs
                title, namespace, redirect, body = "", "0", False, ""
                element.clear()
            del event
