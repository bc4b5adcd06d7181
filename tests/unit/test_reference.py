"""Image references: every accepted form round-trips; bad ones name the column."""

from __future__ import annotations

import pytest

from imgpipe.registry.errors import ReferenceFormatError
from imgpipe.registry.reference import Reference

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "registry", "repo", "tag", "digest"),
    [
        ("head:5000/local/bert:1.0", "head:5000", "local/bert", "1.0", None),
        ("head:5000#local/bert:1.0", "head:5000", "local/bert", "1.0", None),
        ("docker://user@head:5000#local/bert", "head:5000", "local/bert", "latest", None),
        (f"head:5000/local/bert@{DIGEST}", "head:5000", "local/bert", None, DIGEST),
        (f"head:5000/local/bert:1.0@{DIGEST}", "head:5000", "local/bert", "1.0", DIGEST),
        ("localhost/bert", "localhost", "bert", "latest", None),
        ("nvcr.io/nvidia/pytorch:24.05-py3", "nvcr.io", "nvidia/pytorch", "24.05-py3", None),
        ("local/bert:2", "127.0.0.1:5000", "local/bert", "2", None),
    ],
)
def test_forms(text: str, registry: str, repo: str, tag: str | None, digest: str | None) -> None:
    ref = Reference.parse(text, default_registry="127.0.0.1:5000")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repo, tag, digest)
    assert Reference.parse(str(ref)) == ref
    assert Reference.parse(ref.enroot) == ref


def test_enroot_and_filename_forms() -> None:
    ref = Reference.parse("head:5000/local/bert:1.0")
    assert ref.enroot == "head:5000#local/bert:1.0"
    assert ref.filename == "local+bert+1.0"
    pinned = ref.with_digest(DIGEST)
    assert pinned.canonical == f"head:5000/local/bert@{DIGEST}"
    assert pinned.reference == DIGEST


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("head:5000/Local/bert", "bad repository name"),
        ("head:5000/local/bert:", "bad tag"),
        ("head:5000/local/bert@sha256:xyz", "digest must be sha256"),
        ("head:5000/bert:a b", "white space"),
        ("head:5000/bert:$(id)", "bad tag"),
        ("bert", "no registry host"),
        ("", "white space"),
    ],
)
def test_bad_references_explain(text: str, why: str) -> None:
    with pytest.raises(ReferenceFormatError) as caught:
        Reference.parse(text)
    assert why in caught.value.message
    assert "column" in caught.value.message
    assert "host:port/repo:tag" in (caught.value.hint or "")
