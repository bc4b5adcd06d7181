"""Publishing a rendered bundle to the registry as an OCI artifact, and pulling it back.

The bundle travels next to the image it pins: repository ``<image repo>-recipes``,
tagged like the image, so what people ``sbatch`` on the cluster always matches
what CI built.  oras does the OCI artifact protocol.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from imgpipe.recipes.errors import RecipeError
from imgpipe.registry.auth import Credentials
from imgpipe.registry.client import RegistryClient
from imgpipe.registry.manifests import Manifest
from imgpipe.registry.reference import Reference

ARTIFACT_ANNOTATION = "org.imgpipe.recipes"


def _oras(registry: str, scheme: str, credentials: Credentials | None,
          ca_file: str | None) -> Any:
    import oras.client  # imported on use: only publish and pull need it

    client = oras.client.OrasClient(hostname=registry, insecure=scheme == "http",
                                    tls_verify=ca_file or True)
    if credentials is not None:
        client.set_basic_auth(credentials.username, credentials.password)
    return client


def publish(folder: Path, target: Reference, scheme: str,
            credentials: Credentials | None = None, ca_file: str | None = None) -> list[str]:
    """Push every file of ``folder`` as one artifact; returns the file names pushed."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    if "bundle.json" not in names:
        raise RecipeError(f"{folder} is not a rendered bundle (no bundle.json)",
                          hint="imgpipe recipes render first")
    client = _oras(target.registry, scheme, credentials, ca_file)
    with contextlib.chdir(folder):  # oras names each layer by its path relative to here
        response = client.push(target=str(target), files=names, quiet=True,
                               manifest_annotations={ARTIFACT_ANNOTATION: "bundle"})
    if response.status_code not in (200, 201):
        raise RecipeError(f"publishing to {target} failed: HTTP {response.status_code}")
    return names


def refuse_other_artifacts(target: Reference, manifest: Manifest) -> None:
    """Only what `recipes publish` pushed is pulled: a manifest without its annotation (a
    container image, someone else's artifact) is refused before a byte is downloaded."""
    body = manifest.body
    if (body.get("annotations") or {}).get(ARTIFACT_ANNOTATION) == "bundle":
        return
    layers = body.get("layers") or []
    size = sum(int(layer.get("size", 0)) for layer in layers)
    config_type = (body.get("config") or {}).get("mediaType", "")
    what = ("a container image" if "image.config" in config_type or "container.image" in
            config_type else f"an artifact of type {body.get('artifactType') or config_type}")
    raise RecipeError(f"{target} is {what} ({len(layers)} layers, {size / 1e6:.1f} MB), not an "
                      "imgpipe recipe bundle", hint="recipe bundles are published as "
                      "REPO-recipes:TAG (imgpipe registry ls)")


def pull(target: Reference, folder: Path, registry: RegistryClient, scheme: str,
         credentials: Credentials | None = None, ca_file: str | None = None) -> list[Path]:
    """Fetch the bundle ``target`` into ``folder``; scripts come back executable."""
    if registry.manifest_digest(target.repository, target.reference) is None:
        raise RecipeError(f"no recipe bundle {target} in the registry",
                          hint=f"list tags: imgpipe registry tags {target.repository}")
    refuse_other_artifacts(target, registry.manifest(target.repository, target.reference))
    folder.mkdir(parents=True, exist_ok=True)
    client = _oras(target.registry, scheme, credentials, ca_file)
    paths = [Path(p) for p in client.pull(target=str(target), outdir=str(folder))]
    for path in paths:
        if path.suffix == ".sub":
            os.chmod(path, 0o755)
    return sorted(paths)
