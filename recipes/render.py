"""Rendering Slurm recipes (run.sub, dataset.sub, nccl.sub, config_*.sh) for a cluster shape.

Every value that reaches a script is either validated to a strict form (what
goes into ``#SBATCH`` lines, which Slurm reads without a shell) or quoted with
``shlex.quote`` (everything the shell reads), so image names, paths and
environment values cannot inject commands.  Images are pinned: the squashfs
file when one was converted (any Enroot reads it), else Enroot's
``host:port#repo@sha256:…`` form, which never appears in an ``#SBATCH`` line.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jinja2

from imgpipe.base.files import SquashfsPath, atomic_write
from imgpipe.base.platforms import Platform
from imgpipe.recipes.errors import RecipeError
from imgpipe.recipes.ncclscript import check_program
from imgpipe.recipes.profiles import Profile
from imgpipe.recipes.runtimes import RUNTIMES, Runtime, prelude
from imgpipe.recipes.scaling import PHASES, Shape, shape_for
from imgpipe.recipes.staging import DISTRIBUTIONS, Distribution, stage_function
from imgpipe.registry.errors import ReferenceFormatError
from imgpipe.registry.reference import Reference

# Each job writes the image it runs in where the report reads it: one JSON object in
# RESULTSDIR/<job name>-<job id>/ran_in.json (imgpipe.recipes.report), written whole.
RECORD_IMAGE = r"""# The image this job runs in, where the report reads it: FOLDER/ran_in.json.
json_string() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "$s"
}
record_image() {
  local folder=$1
  mkdir -p "$folder"
  printf '{"job": %s, "id": %s, "image": %s, "image_digest": %s, "profile": %s}\n' \
    "$(json_string "${SLURM_JOB_NAME:-}")" "$(json_string "${SLURM_JOB_ID:-}")" \
    "$(json_string "$CONT")" "$(json_string "$image_digest")" '@PROFILE@' \
    >"$folder/.ran_in.json.$$"
  mv -f "$folder/.ran_in.json.$$" "$folder/ran_in.json"
}"""
SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.:@+=,/-]{1,128}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SIGNAL_LEAD_S = 300


@dataclass(frozen=True)
class RecipeInputs:
    profile: Profile
    nodes: int
    # the lock's pin (a checked squashfs file, or the pushed digest), or what a user typed
    image: Reference | SquashfsPath | str
    runtime: Runtime = "pyxis"
    nccl_image: Reference | SquashfsPath | str | None = None
    # Enroot 3.x on the nodes rejects @sha256 references: pyxis recipes then need files
    enroot_takes_digests: bool = True
    enroot_seen: str = ""  # which Enroot said so, for the error
    data_dir: str = "/lustre/bert/data"
    checkpoint_dir: str = "/lustre/bert/checkpoints"
    results_dir: str = "/lustre/bert/results"
    dataset_source: str = "/lustre/bert/source"
    vocab: str = "/lustre/bert/vocab.txt"
    bert_config: str = ""  # a host file; empty: the image's own (BERT-Large)
    partition: str | None = None
    walltime_minutes: int = 480
    shards: int | None = None  # None: the job derives it from the corpus size
    env: dict[str, str] = field(default_factory=dict)
    adjust_global_batch: bool = False
    # An index build: platform (linux/arm64) -> that platform's pin; the scripts pick the
    # node's (``image`` is then the first, for what shows one)
    platform_images: dict[str, Reference | SquashfsPath | str] = field(default_factory=dict)
    selftest: tuple[str, ...] = ()  # the image's self-test argv: run.sub's SELFTEST mode
    # the manifest digest of ``image`` / of each platform's pin: what the jobs record they ran
    image_digest: str = ""
    platform_digests: dict[str, str] = field(default_factory=dict)
    # how the image reaches the nodes (enroot.distribution; recipes.staging)
    distribution: Distribution = "shared"
    importer_path: str = "/usr/local/bin/imgpipe-pyxis-importer"
    sbcast_fanout: int = 4
    sbcast_block: str = "8M"


def _sbatch_value(value: str, what: str) -> str:
    if not SBATCH_SAFE.match(value):
        raise RecipeError(f"{what} {value!r} cannot go in an #SBATCH line",
                          hint="use letters, digits and . _ : @ + = , / - only")
    return value


def _shell_value(value: str, what: str) -> str:
    if "\x00" in value:
        raise RecipeError(f"{what} contains a NUL byte")
    return value


def _path(value: str, what: str) -> str:
    _shell_value(value, what)
    if "\n" in value or not value.strip():
        raise RecipeError(f"{what} {value!r} is not a usable path")
    return value


def pinned_image(image: Reference | SquashfsPath | str) -> str:
    """A squashfs path as is; a reference checked and written in Enroot's form."""
    if isinstance(image, SquashfsPath):
        return _path(str(image), "image path")
    if isinstance(image, Reference):
        ref = image
    elif image.startswith(("/", "./")):
        return _path(image, "image path")
    else:
        try:
            ref = Reference.parse(image)
        except ReferenceFormatError as exc:
            raise RecipeError(f"image {image!r} is neither a squashfs path nor a reference",
                              hint=exc.hint) from exc
    if ref.digest is None:
        raise RecipeError(f"image {image!r} is not pinned to a digest",
                          hint="recipes pin bytes, not names: push it, then render again")
    return ref.enroot


def cont_choice(image: str, digest: str, platform_images: dict[str, str],
                platform_digests: dict[str, str], script: str) -> str:
    """Bash that sets ``default_cont`` and ``default_image_digest``: the one pin, or each
    platform's, picked by the node's platform (``IMGPIPE_PLATFORM``, else ``uname -m``:
    the importer's rule)."""
    if len(set(platform_images.values())) <= 1:
        only = next(iter(platform_images.values()), image)
        chosen = next(iter(platform_digests.values()), digest)
        return (f"default_cont={shlex.quote(only)}\n"
                f"default_image_digest={shlex.quote(_digest(chosen))}")
    lines = ["# One image per platform: the node's (IMGPIPE_PLATFORM, else uname -m) picks.",
             'node_platform="${IMGPIPE_PLATFORM:-$(uname -m)}"',
             'case "$node_platform" in']
    for name, pinned in platform_images.items():
        parsed = Platform.parse(name)
        known = _digest(platform_digests.get(name, ""))
        lines.append(f"  {name}|{parsed.machine}) default_cont={shlex.quote(pinned)}; "
                     f"default_image_digest={shlex.quote(known)} ;;")
    offered = " ".join(platform_images)
    lines += [f'  *) echo "{script}: no image for platform $node_platform (this bundle has '
              f'{offered})" >&2; exit 2 ;;', "esac"]
    return "\n".join(lines)


def _reference_digest(pinned: str) -> str:
    """The digest a pinned reference names (``…@sha256:…``); a squashfs path names none."""
    return "sha256:" + pinned.rsplit("@sha256:", 1)[1] if "@sha256:" in pinned else ""


def _digest(value: str) -> str:
    if value and not re.match(r"^sha256:[0-9a-f]{64}$", value):
        raise RecipeError(f"{value!r} is not a sha256 digest")
    return value


def _walltime(minutes: int) -> str:
    if minutes < 1 or minutes > 60 * 24 * 30:
        raise RecipeError(f"walltime of {minutes} minutes is out of range")
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def _environment(inputs: RecipeInputs) -> list[tuple[str, str]]:
    env: dict[str, str] = {}
    if inputs.profile.hcas:
        env["NCCL_IB_HCA"] = ",".join(inputs.profile.hcas)
        if inputs.runtime == "pyxis":
            # Enroot's Mellanox hook exposes the HCAs only when this is set; without it
            # NCCL falls back to sockets inside the container.
            env["MELLANOX_VISIBLE_DEVICES"] = "all"
    env.update(inputs.profile.nccl_env)
    env.update(inputs.profile.enroot_env)
    env.update(inputs.env)
    for name, value in env.items():
        if not ENV_NAME.match(name):
            raise RecipeError(f"environment name {name!r} is not a valid shell variable")
        _shell_value(value, f"environment value of {name}")
    return sorted(env.items())


def _jinja() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("imgpipe.recipes", "templates"),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False,
        trim_blocks=False,
    )
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    return env


@dataclass(frozen=True)
class Bundle:
    folder: Path
    files: list[Path]
    shapes: list[Shape]
    image: str


def max_bytes(profile: Profile) -> str:
    """all_reduce_perf's largest message: its send and receive buffers (2x) must leave room
    for NCCL on the smallest GPU (a quarter of its memory), at most 8G."""
    if not profile.is_gpu:
        return "64M"
    gib = 1
    while gib * 2 <= min(8, profile.gpu.memory_gb // 4):
        gib *= 2
    return f"{gib}G"


def render_bundle(inputs: RecipeInputs, folder: Path, phases: tuple[int, ...] = (1, 2)
                  ) -> Bundle:
    """Write run.sub, dataset.sub, nccl.sub and one config file per phase into ``folder``."""
    profile = inputs.profile
    if inputs.runtime not in RUNTIMES:
        raise RecipeError(f"runtime {inputs.runtime!r} is not one of {', '.join(RUNTIMES)}")
    if inputs.distribution not in DISTRIBUTIONS:
        raise RecipeError(f"distribution {inputs.distribution!r} is not one of "
                          f"{', '.join(DISTRIBUTIONS)}")
    shapes = [shape_for(profile, inputs.nodes, phase, inputs.adjust_global_batch)
              for phase in phases]
    image = pinned_image(inputs.image)
    platform_images = {str(Platform.parse(name)): pinned_image(pin)
                       for name, pin in inputs.platform_images.items()}
    nccl_image = pinned_image(inputs.nccl_image) if inputs.nccl_image else image
    if inputs.runtime == "pyxis" and not inputs.enroot_takes_digests:
        for shown in {image, nccl_image, *platform_images.values()}:
            if "@sha256:" in shown:
                raise RecipeError(
                    f"the nodes' Enroot ({inputs.enroot_seen}) rejects digest references "
                    f"such as {shown}", hint="convert the image (imgpipe convert, or push "
                    "--convert) so the recipes pin its squashfs file, or upgrade Enroot to 4.0")
    context = {
        "profile": profile, "nodes": inputs.nodes, "runtime": inputs.runtime,
        "image": image, "nccl_image": nccl_image,
        "per_platform": len(set(platform_images.values())) > 1,
        "selftest": " ".join(shlex.quote(arg) for arg in inputs.selftest),
        "partition": _sbatch_value(inputs.partition or profile.partition, "partition"),
        "walltime": _walltime(inputs.walltime_minutes),
        "walltime_minutes": inputs.walltime_minutes,
        "dataset_walltime": _walltime(48 * 60),
        "signal_lead_s": SIGNAL_LEAD_S,
        "data_dir": _path(inputs.data_dir, "data directory"),
        "checkpoint_dir": _path(inputs.checkpoint_dir, "checkpoint directory"),
        "results_dir": _path(inputs.results_dir, "results directory"),
        "dataset_source": _path(inputs.dataset_source, "dataset source"),
        "vocab": _path(inputs.vocab, "vocabulary file"),
        "bert_config": _path(inputs.bert_config, "BERT config file")
        if inputs.bert_config else "",
        "prelude": prelude(inputs.runtime).rstrip("\n"),
        "stage": stage_function(inputs.runtime, inputs.distribution,
                                _path(inputs.importer_path, "importer path"),
                                inputs.sbcast_fanout, inputs.sbcast_block),
        "checker": check_program(profile.name, profile.busbw_gbs),
        "shards": int(inputs.shards) if inputs.shards else None,
        "dataset_tasks": max(1, profile.cores_per_node // 2),
        "env": _environment(inputs),
        "bench": "all_reduce_perf" if inputs.nccl_image else "pytorch",
        "max_bytes": max_bytes(profile),
        "phases": [(p, PHASES[p]["seq_len"], PHASES[p]["max_pred"]) for p in sorted(PHASES)],
        "config_names": [shape.config_name for shape in shapes],
    }
    templates = _jinja()
    # Every job records the profile it was rendered for: the report judges NCCL by it.
    record_image = RECORD_IMAGE.replace("@PROFILE@", json.dumps(
        {"name": profile.name, "busbw_gbs": profile.busbw_gbs,
         "gpus_per_node": profile.gpus_per_node}).replace("'", ""))
    written = []
    for name in ("run.sub", "dataset.sub", "nccl.sub"):
        if name != "nccl.sub" or not inputs.nccl_image:  # the bert image
            chosen = cont_choice(image, inputs.image_digest, platform_images,
                                 inputs.platform_digests, name)
        else:  # the nccl-tests image: its digest is in its reference when it is one
            chosen = cont_choice(nccl_image, _reference_digest(nccl_image), {}, {}, name)
        text = templates.get_template(f"{name}.j2").render(**context, shape=shapes[0],
                                                           cont_choice=chosen,
                                                           record_image=record_image)
        written.append(atomic_write(folder / name, text, mode=0o755))
    for shape in shapes:
        text = templates.get_template("config.sh.j2").render(**context, shape=shape)
        written.append(atomic_write(folder / shape.config_name, text, mode=0o644))
    meta = {"profile": profile.name, "profile_used": profile.model_dump(mode="json"),
            "nodes": inputs.nodes, "runtime": inputs.runtime,
            "image": image, "nccl_image": nccl_image,
            **({"platform_images": platform_images} if platform_images else {}),
            "shapes": [asdict(shape) for shape in shapes],
            "files": sorted(p.name for p in written)}
    written.append(atomic_write(folder / "bundle.json", json.dumps(meta, indent=2) + "\n"))
    return Bundle(folder, written, shapes, image)
