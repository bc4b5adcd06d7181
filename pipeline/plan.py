"""Change planning: one content hash over everything that shapes an image.

The hash covers the Dockerfile, every context file after .dockerignore (path,
mode, content), the build args, the flavor, the static labels, the names of
the secrets used (never their values), the offered wheels, and the base image's
digest when it can be resolved (its name otherwise).  An image whose hash
matches its last push (imgpipe.lock) is up to date and is not built.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from imgpipe.base.platforms import Platform
from imgpipe.pipeline.catalog import Image
from imgpipe.pipeline.context import ContextFile, context_files, wheels_in
from imgpipe.pipeline.lock import LockFile

Action = Literal["build", "up to date"]
INPUT_NAMES = ("dockerfile", "context", "build_args", "flavor", "base", "labels", "secrets",
               "wheels")
PLATFORM_INPUT = ("platforms",)  # an index build's platforms and each one's base


def _digest(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class PlanItem:
    image: Image
    flavor: str
    build_args: dict[str, str]
    base_digest: str | None
    inputs: dict[str, str]
    files: list[ContextFile] = field(repr=False)
    action: Action = "build"
    reason: str = ""
    # The platforms of an index build (one manifest each under one index); empty: one
    # manifest of the build host's platform, as before platforms were named
    platforms: tuple[Platform, ...] = ()
    # Each of those platforms' base, as the plan found it (its digest or image ID), or None
    # where it is neither in the engine nor in its registry: the build refuses to start then
    platform_base_digests: dict[str, str | None] = field(default_factory=dict)

    @property
    def input_hash(self) -> str:
        return "sha256:" + _digest({k: self.inputs[k] for k in INPUT_NAMES + PLATFORM_INPUT
                                    if k in self.inputs})

    def base_for(self, platform: Platform) -> str:
        """The BASE_IMAGE of this build for ``platform``."""
        base = self.build_args["BASE_IMAGE"]
        flavor = self.image.flavor(self.flavor)
        return flavor.base_for(platform) if base == flavor.base else base

    @property
    def key(self) -> str:
        return f"{self.image.name}/{self.flavor}"


def build_args_for(image: Image, flavor: str, overrides: dict[str, str],
                   base_override: str | None = None) -> dict[str, str]:
    spec = image.flavor(flavor)
    args = {**spec.build_args, **overrides}
    args["BASE_IMAGE"] = base_override or spec.base
    args["FLAVOR"] = flavor
    return dict(sorted(args.items()))


def compute_inputs(image: Image, flavor: str, build_args: dict[str, str],
                   base_digest: str | None, wheels_dir: Path | None
                   ) -> tuple[dict[str, str], list[ContextFile]]:
    files = context_files(image.folder)
    listing = [[f.path, f.mode, f.digest] for f in files]
    inputs = {
        "dockerfile": _digest(image.dockerfile.read_bytes().decode(errors="replace")),
        "context": _digest(listing),
        "build_args": _digest(build_args),
        "flavor": flavor,
        "base": base_digest or f"unresolved:{build_args['BASE_IMAGE']}",
        "labels": _digest(image.spec.labels),
        "secrets": _digest(sorted(image.spec.secrets)),
        "wheels": _digest([[w.name, w.sha256] for w in wheels_in(wheels_dir)]),
    }
    return inputs, files


def plan_image(image: Image, flavor: str, lock: LockFile, *, overrides: dict[str, str],
               base_override: str | None, wheels_dir: Path | None,
               resolve_base: Callable[[str], str | None], force: bool = False,
               platforms: tuple[Platform, ...] = ()) -> PlanItem:
    """Decide whether ``image`` in ``flavor`` needs a build, and say why.  ``platforms``
    (else image.yaml's, else none: the build host's one manifest) makes an index build."""
    build_args = build_args_for(image, flavor, overrides, base_override)
    base_digest = resolve_base(build_args["BASE_IMAGE"])
    inputs, files = compute_inputs(image, flavor, build_args, base_digest, wheels_dir)
    chosen = platforms or (image.platforms if image.spec.platforms else ())
    item = PlanItem(image, flavor, build_args, base_digest, inputs, files, platforms=chosen)
    if chosen:
        found = {p: resolve_base(item.base_for(p)) for p in chosen}
        inputs["platforms"] = _digest({str(p): digest or f"unresolved:{item.base_for(p)}"
                                       for p, digest in found.items()})
        item = replace(item, platform_base_digests={str(p): d for p, d in found.items()})
    previous = lock.entry(image.name, flavor)
    if force:
        return replace(item, action="build", reason="--force")
    if previous is None:
        return replace(item, action="build", reason="never pushed")
    if previous.input_hash == item.input_hash:
        return replace(item, action="up to date",
                   reason=f"inputs match the push of {previous.pushed_at} ({previous.digest[:19]})")
    changed = [name for name in INPUT_NAMES + PLATFORM_INPUT
               if previous.inputs.get(name) != inputs.get(name)]
    return replace(item, action="build", reason="changed: " + ", ".join(changed or ["hash"]))

