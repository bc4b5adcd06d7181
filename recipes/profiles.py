"""Cluster profiles: the shape of a site's nodes, shipped ones plus a site's own folder."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from imgpipe.base.config import format_validation_error
from imgpipe.recipes.errors import ProfileError, RecipeError

SHIPPED = ("dgx1", "dgx2", "dgx-a100", "dgx-h100", "local")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Gpu(_Strict):
    model: str
    memory_gb: int = Field(ge=0)
    precision: Literal["fp16", "bf16", "fp32"]
    peak_tflops: float = Field(gt=0, description="dense peak at that precision, for MFU")


class BertOverrides(_Strict):
    """A profile may shrink the recipe (tests, laptops); clusters keep the published one."""

    global_batch: tuple[int, int] | None = None
    max_steps: tuple[int, int] | None = None


class Profile(_Strict):
    name: str
    description: str = ""
    gpus_per_node: int = Field(ge=1, le=64)
    gpu: Gpu
    hcas: list[str] = Field(default_factory=list)
    busbw_gbs: float = Field(gt=0, description="expected inter-node all-reduce bus bandwidth")
    cores_per_node: int = Field(ge=1)
    partition: str = "batch"
    nccl_env: dict[str, str] = Field(default_factory=dict)
    enroot_env: dict[str, str] = Field(default_factory=dict)
    bert: BertOverrides = BertOverrides()

    @property
    def is_gpu(self) -> bool:
        return self.gpu.memory_gb > 0


def _parse(text: str, where: str) -> Profile:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{where}: not valid YAML") from exc
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: must be a mapping")
    try:
        return Profile(**raw)
    except ValidationError as exc:
        raise ProfileError(format_validation_error(Path(where), exc)) from exc


def load_profile(name: str, site_dir: Path | None = None) -> Profile:
    """A site's profile (``site_dir/NAME.yaml``) wins over a shipped one of the same name."""
    if site_dir is not None and (site_dir / f"{name}.yaml").is_file():
        path = site_dir / f"{name}.yaml"
        return _parse(path.read_text(), str(path))
    shipped = resources.files("imgpipe.recipes").joinpath("profile_files", f"{name}.yaml")
    if shipped.is_file():
        return _parse(shipped.read_text(), f"profiles/{name}.yaml")
    known = sorted(set(SHIPPED) | {p.stem for p in (site_dir.glob("*.yaml") if site_dir
                                                     and site_dir.is_dir() else [])})
    raise ProfileError(f"unknown profile {name!r} (known: {', '.join(known)})",
                      hint="add NAME.yaml to recipes.profiles_dir, or use a shipped one")
