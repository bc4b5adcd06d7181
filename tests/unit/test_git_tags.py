"""Tags and labels from git, by docker's metadata conventions, on a real repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from imgpipe.pipeline.gitinfo import revision, semver_tags, source_url


def git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q", "-b", "main")
    git(tmp_path, "config", "user.email", "ci@example.org")
    git(tmp_path, "config", "user.name", "ci")
    (tmp_path / "image.yaml").write_text("name: x\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "one")
    git(tmp_path, "remote", "add", "origin", "git@github.com:site/imgpipe-images.git")
    return tmp_path


def test_branch_sha_and_release_tags_of_a_clean_checkout(repo: Path) -> None:
    full = git(repo, "rev-parse", "HEAD")
    found = revision(repo, environ={})
    assert found is not None and found.ref_tags() == ["main", f"sha-{full[:7]}"]
    git(repo, "checkout", "-q", "-b", "feature/faster-io")
    git(repo, "tag", "v1.4.2")
    assert revision(repo, environ={}).ref_tags() == [  # type: ignore[union-attr]
        "feature-faster-io", "v1.4.2", "1.4.2", "1.4", "1", f"sha-{full[:7]}"]
    assert revision(repo, environ={}).source == "https://github.com/site/imgpipe-images"  # type: ignore[union-attr]


def test_actions_refs_for_a_pull_request_and_a_tag(repo: Path) -> None:
    full = git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "--detach")
    pr = revision(repo, environ={"GITHUB_ACTIONS": "true", "GITHUB_REF": "refs/pull/42/merge"})
    assert pr is not None and pr.ref_tags() == ["pr-42", f"sha-{full[:7]}"]
    tag = revision(repo, environ={"GITHUB_ACTIONS": "true", "GITHUB_REF": "refs/tags/v0.3.0"})
    assert tag is not None and tag.ref_tags() == ["v0.3.0", "0.3.0", "0.3", f"sha-{full[:7]}"]


def test_a_dirty_tree_claims_no_ref(repo: Path) -> None:
    (repo / "image.yaml").write_text("name: y\n")
    found = revision(repo, environ={})
    assert found is not None and found.dirty and found.ref_tags() == []
    assert found.tag.endswith("-dirty")


@pytest.mark.parametrize(("tag", "expected"), [
    ("v2.0.0", ["2.0.0", "2.0", "2"]), ("1.2.3-rc.1", ["1.2.3-rc.1"]),
    ("0.1.0", ["0.1.0", "0.1"]), ("release-7", []), ("v1.2", []),
])
def test_semver_forms(tag: str, expected: list[str]) -> None:
    assert semver_tags(tag) == expected


@pytest.mark.parametrize(("remote", "url"), [
    ("git@github.com:site/images.git", "https://github.com/site/images"),
    ("https://token@gitlab.example.org/hpc/images.git", "https://gitlab.example.org/hpc/images"),
    ("ssh://git@github.com/site/images", "https://github.com/site/images"),
    ("/srv/git/images.git", None), (None, None),
])
def test_the_source_label_is_a_url_never_a_path_or_a_credential(remote: str | None,
                                                                url: str | None) -> None:
    assert source_url(remote) == url
