"""`imgpipe site init`: a site's config and its own cluster profile, in one command.

What an admin of an existing cluster answers once: the head-node registry (with TLS, the site's
CA), the flavor jobs run (ngc), where squashfs files go, the partition and the data paths, and
the nodes' shape.  Written as ``/etc/imgpipe/imgpipe.yaml`` (the site's layer, root's, 0644)
and ``/etc/imgpipe/profiles/NAME.yaml``; both are checked by the same models every command
reads them with before anything is written, and an existing file is never overwritten unasked.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from imgpipe.base.adminpath import Admins, walk_admin_folder
from imgpipe.base.configcheck import conflicts
from imgpipe.base.configlayers import SITE_CONFIG, parse_settings
from imgpipe.base.errors import ConfigError
from imgpipe.base.files import atomic_write
from imgpipe.base.mounts import filesystem_type, is_shared_type
from imgpipe.commands.site.nccl import site_profile
from imgpipe.commands.site.profiles import NAME, profile_text
from imgpipe.recipes.profiles import Profile

__all__ = ["SiteAnswers", "init_site"]


@dataclass(frozen=True)
class SiteAnswers:
    registry: str  # HOST[:PORT]
    squashfs_dir: Path
    partition: str
    data_root: Path  # data, checkpoints, results, sources and the vocabulary below it
    ca_file: Path | None = None  # the registry's CA: https; None with plain_http
    plain_http: bool = False
    flavor: str = "ngc"
    profile: str = "site"
    base_profile: str = "dgx-h100"
    gpus_per_node: int | None = None
    hcas: list[str] | None = None
    cores_per_node: int | None = None
    gpu_memory_gb: int | None = None
    busbw_gbs: float | None = None
    config: Path = SITE_CONFIG
    overwrite: bool = False
    distribution: str | None = None  # None: shared on a cluster file system, else asked
    pyxis_importer: bool | None = None  # the nodes' Pyxis line has importer=
    cache_owner: str | None = None  # the cache's service account (root squash: root cannot write)
    credentials: str | None = None  # where each user reads a registry login: netrc, docker-config
    notes: list[str] = field(default_factory=list)


def _registry(answers: SiteAnswers) -> dict[str, object]:
    host, _, port = answers.registry.rpartition(":") if ":" in answers.registry else (
        answers.registry, "", "5000")
    if not port.isdigit():
        raise ConfigError(f"--registry {answers.registry}: say HOST or HOST:PORT")
    if answers.ca_file is None and not answers.plain_http:
        raise ConfigError("the registry's TLS CA is needed (--registry-ca FILE)",
                          hint="or --plain-http: imgpipe's importer fetches over http by "
                          "itself; only Enroot pulling imgpipe's images without the importer "
                          "would need ENROOT_ALLOW_HTTP, which switches every registry to http")
    values: dict[str, object] = {"host": host, "port": int(port),
                                 "scheme": "http" if answers.plain_http else "https"}
    if answers.ca_file is not None:
        if not answers.ca_file.is_file():
            raise ConfigError(f"--registry-ca {answers.ca_file}: no such file")
        values["ca_file"] = str(answers.ca_file.resolve())
    if answers.credentials:
        if answers.plain_http:
            raise ConfigError(f"--credentials {answers.credentials} with --plain-http: every "
                              "user's registry password would cross the network in clear",
                              hint="give the registry TLS (--registry-ca FILE)")
        values["credentials"] = {"source": answers.credentials}
    return values


def distribution_of(answers: SiteAnswers) -> str:
    """How images reach the nodes: as said, else ``shared`` for a folder on a cluster file
    system; a folder on a disk of this host alone must be said (node-local or not)."""
    if answers.distribution is not None:
        return answers.distribution
    kind = filesystem_type(answers.squashfs_dir)
    if is_shared_type(kind):
        return "shared"
    raise ConfigError(f"--squashfs-dir {answers.squashfs_dir} is on {kind or 'an unknown'} "
                      "file system, a disk of this host alone: say how images reach the nodes",
                      hint="--distribution sbcast or fetch (a node-local folder on every node), "
                      "or shared (the same folder on every node)")


def site_config(answers: SiteAnswers) -> dict[str, object]:
    data = answers.data_root
    enroot: dict[str, object] = {"distribution": distribution_of(answers)}
    if answers.pyxis_importer is not None:
        enroot["pyxis_importer"] = answers.pyxis_importer
    if answers.cache_owner:
        enroot["cache_owner"] = answers.cache_owner
    return {
        "registry": _registry(answers),
        "default_flavor": answers.flavor,
        "outputs": {"squashfs_dir": str(answers.squashfs_dir)},
        "enroot": enroot,
        "recipes": {"profiles_dir": str(answers.config.parent / "profiles"),
                    "partition": answers.partition,
                    "data_dir": str(data / "data"), "checkpoint_dir": str(data / "checkpoints"),
                    "results_dir": str(data / "results"), "dataset_source": str(data / "source"),
                    "vocab": str(data / "vocab.txt")},
    }


def site_profile_of(answers: SiteAnswers, base: Profile) -> Profile:
    changes: dict[str, object] = {"name": answers.profile, "partition": answers.partition,
                                  "description": f"this site's nodes (from {base.name})"}
    for key, value in (("gpus_per_node", answers.gpus_per_node), ("hcas", answers.hcas),
                       ("cores_per_node", answers.cores_per_node),
                       ("busbw_gbs", answers.busbw_gbs)):
        if value is not None:
            changes[key] = value
    if answers.gpu_memory_gb is not None:
        changes["gpu"] = base.gpu.model_copy(update={"memory_gb": answers.gpu_memory_gb})
    return Profile.model_validate(base.model_copy(update=changes).model_dump())


def init_site(answers: SiteAnswers) -> list[Path]:
    """Write the site config and profile (both validated first); the paths written."""
    if not NAME.fullmatch(answers.profile):
        raise ConfigError(f"--profile-name {answers.profile!r}: use lower-case letters, "
                          "digits, '.', '_' and '-'")
    config = answers.config
    profile_path = config.parent / "profiles" / f"{answers.profile}.yaml"
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    text = (f"# The site's imgpipe config, written by `imgpipe site init` on {stamp}.\n"
            "# Every key: docs/reference/configuration.md; check: imgpipe config show --origin\n"
            + yaml.safe_dump(site_config(answers), sort_keys=False))
    from imgpipe.base.config import Settings  # the shipped defaults, for the base profile

    profile = site_profile_of(answers, site_profile(Settings(), answers.base_profile))
    wanted = {config: text, profile_path: profile_text(profile)}
    if all(_same(path, content) for path, content in wanted.items()):
        return []  # the same answers again: nothing to do
    for path in wanted:
        if path.exists() and not answers.overwrite:
            raise ConfigError(f"{path} exists already, with other values",
                              hint="edit it, or pass --force")
    for folder in (config.parent, profile_path.parent):
        if os.geteuid() == 0:  # never through a link, never below a user's folder
            walk_admin_folder(folder, Admins.of(), create_mode=0o755, adopt=lambda names: None,
                              refuse=lambda what, hint: ConfigError(what, hint=hint))
        else:
            folder.mkdir(parents=True, exist_ok=True)
    import tempfile

    fd, name = tempfile.mkstemp(prefix=f".{config.name}.", suffix=".check", dir=config.parent)
    staged = Path(name)  # made exclusively under a name nobody can guess, then removed
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        found = conflicts(parse_settings(staged))  # the same model every command uses
        if found:
            raise ConfigError(f"these answers cannot work together: {found[0]}")
    finally:
        staged.unlink(missing_ok=True)
    return [atomic_write(profile_path, profile_text(profile), mode=0o644),
            atomic_write(config, text, mode=0o644)]


def _same(path: Path, content: str) -> bool:
    """Whether ``path`` holds ``content`` already (its first line, a date, aside)."""
    try:
        found = path.read_text()
    except OSError:
        return False
    return found.split("\n", 1)[-1] == content.split("\n", 1)[-1]
