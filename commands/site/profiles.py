"""`imgpipe recipes profile new|check|list`: a site's own cluster profile, copied from a shipped
one and checked against the node it describes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from imgpipe.base.config import Settings
from imgpipe.base.errors import ConfigError
from imgpipe.base.files import atomic_write
from imgpipe.commands.site.nccl import site_profile
from imgpipe.recipes.profilecheck import ProfileCheck, check, node_facts
from imgpipe.recipes.profiles import SHIPPED, Profile

__all__ = ["ProfileCheck", "check_profile", "known_profiles", "new_profile", "profile_text"]

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
HEADER = """\
# A cluster profile for imgpipe (docs/reference/profiles.md lists every key).
# Check it on a compute node: imgpipe recipes profile check {name}
"""


def profile_text(profile: Profile) -> str:
    """A profile as the YAML file a site keeps (keys in the model's order, defaults too)."""
    body = yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False,
                          default_flow_style=None, width=96)
    return HEADER.format(name=profile.name) + body


def new_profile(settings: Settings, name: str, base: str, folder: Path | None) -> Path:
    """Copy profile ``base`` as ``name`` into ``folder`` (default recipes.profiles_dir)."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"profile name {name!r}: use lower-case letters, digits, '.', '_' "
                          "and '-'")
    where = folder or (settings.path(settings.recipes.profiles_dir)
                       if settings.recipes.profiles_dir else None)
    if where is None:
        raise ConfigError("where should the profile go?",
                          hint="pass -o DIR, or set recipes.profiles_dir in imgpipe.yaml")
    path = where / f"{name}.yaml"
    if path.exists():
        raise ConfigError(f"{path} exists already", hint="edit it, or choose another name")
    copied = site_profile(settings, base).model_copy(
        update={"name": name, "description": f"copied from {base}: edit to match the nodes"})
    return atomic_write(path, profile_text(copied), mode=0o644)


def known_profiles(settings: Settings) -> list[tuple[str, str]]:
    """(name, description) of every shipped profile and the site's own."""
    names = set(SHIPPED)
    folder = settings.recipes.profiles_dir
    if folder and settings.path(folder).is_dir():
        names |= {p.stem for p in settings.path(folder).glob("*.yaml")}
    return [(name, site_profile(settings, name).description) for name in sorted(names)]


def check_profile(settings: Settings, name: str) -> ProfileCheck:
    return check(site_profile(settings, name), node_facts())
