"""The reference pages generated from the code: configuration keys (from the pydantic models),
the profile format and the shipped profiles, and the environment the job scripts and the Pyxis
importer read.  ``cli/reference.py`` adds the commands (from click) and writes docs/reference/;
tests/unit/test_docs_drift.py fails when a page differs from what the code says."""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from imgpipe.base.config import TRUSTED_KEYS, Settings
from imgpipe.recipes.profiles import SHIPPED, Gpu, Profile, load_profile

__all__ = ["ENVIRONMENT", "config_page", "environment_page", "profiles_page",
           "template_variables"]

GENERATED = ("<!-- Generated from the code by `python -m imgpipe.cli.reference --write "
             "docs/reference`; tests/unit/test_docs_drift.py keeps it so.  Do not edit. -->\n")


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """(dotted key, type, default, description) of every leaf field, in the model's order."""
    rows: list[tuple[str, Any, Any, str]] = []
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        args = getattr(field.annotation, "__args__", ()) or (field.annotation,)
        sub = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is not None:
            rows += _fields(sub, f"{prefix}{name}.")
            continue
        default = field.default if field.default is not PydanticUndefined else (
            field.default_factory() if field.default_factory else None)  # type: ignore[call-arg]
        rows.append((f"{prefix}{name}", field.annotation, default,
                     " ".join((field.description or "").split())))
    return rows


def _type(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("pathlib.", "")
    text = re.sub(r"<class '(\w+)'>", r"\1", text)
    return text.replace("Literal", "one of ").replace("PosixPath", "Path")


def _default(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, str):
        return f'"{value}"' if value else '""'
    return str(value).replace("PosixPath('", "").replace("')", "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_keys() -> list[str]:
    return [key for key, *_ in _fields(Settings)]


def config_page() -> str:
    lines = [GENERATED, "# Configuration keys", "",
             "Every key `imgpipe.yaml` may hold, its type, default and meaning. The files it is "
             "read from, each overriding the one before key by key: `/etc/imgpipe/imgpipe.yaml` "
             "(the site's), `$XDG_CONFIG_HOME/imgpipe/imgpipe.yaml` (yours), the nearest "
             "`imgpipe.yaml` above the working directory (the project's), then `--config FILE` "
             "or `IMGPIPE_CONFIG`. `imgpipe config show --origin` prints every effective key "
             "and the file that set it. Relative paths are relative to the file that names "
             "them.", "",
             "Keys only a file root owns (and nobody else may write) may set, because the "
             "threat model trusts them: " + ", ".join(f"`{k}`" for k in TRUSTED_KEYS) + ". "
             "The Pyxis importer and the cache writer read one file: `IMGPIPE_CONFIG` (or the "
             "writer's `--config`), else `/etc/imgpipe/imgpipe.yaml`.", ""]
    section = None
    for key, annotation, default, description in _fields(Settings):
        top = key.split(".")[0] if "." in key else "top level"
        if top != section:
            section = top
            lines += ["", f"## {section}", "", "| key | type | default | meaning |",
                      "|---|---|---|---|"]
        lines.append(f"| `{key}` | {_cell(_type(annotation))} | {_cell(_default(default))} | "
                     f"{_cell(description)} |")
    return "\n".join(lines) + "\n"


def profiles_page() -> str:
    lines = [GENERATED, "# Cluster profiles", "",
             "A profile is a cluster's node shape: what `imgpipe recipes render` scales the "
             "BERT recipe to, and what `imgpipe report` and `imgpipe nccl check` judge the "
             "fabric by. The shipped ones are below; a site keeps its own as `NAME.yaml` in "
             "`recipes.profiles_dir` (a site's wins over a shipped one of the same name). "
             "Start from one (`imgpipe recipes profile new NAME --from dgx-h100`), edit it, "
             "then check it on a compute node (`imgpipe recipes profile check NAME`).", "",
             "## The format", "", "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, annotation, default, description in _fields(Profile):
        lines.append(f"| `{key}` | {_cell(_type(annotation))} | {_cell(_default(default))} | "
                     f"{_cell(description)} |")
    lines += ["", "`gpu` holds:", "", "| key | type | meaning |", "|---|---|---|"]
    for key, annotation, _, description in _fields(Gpu):
        lines.append(f"| `gpu.{key}` | {_cell(_type(annotation))} | {_cell(description)} |")
    lines += ["", "## Shipped profiles", "",
              "| name | GPUs per node | GPU | HCAs | expected bus bandwidth | cores | "
              "partition |", "|---|---|---|---|---|---|---|"]
    for name in SHIPPED:
        p = load_profile(name)
        lines.append(f"| `{name}` | {p.gpus_per_node} | {p.gpu.model} ({p.gpu.memory_gb} GB) "
                     f"| {len(p.hcas)} | {p.busbw_gbs:g} GB/s | {p.cores_per_node} | "
                     f"`{p.partition}` |")
    lines += ["", "An example, `dgx-h100` as shipped:", "", "```yaml",
              resources.files("imgpipe.recipes").joinpath(
                  "profile_files", "dgx-h100.yaml").read_text().rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


# What a user may set for the rendered job scripts (sbatch --export, or exported before
# sbatch), and what the Pyxis importer reads.  Every variable the templates read with a
# default (or require) is here; tests/unit/test_docs_admin.py compares this with the templates
# and runs each switch both ways.
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "CONT": ("all", "the image the job runs in (default: the one pinned when rendered)"),
    "IMGPIPE_IMAGE_DIGEST": ("all", "the digest of CONT when CONT is not the rendered default "
                             "(recorded in ran_in.json)"),
    "IMGPIPE_PLATFORM": ("run.sub", "this node's platform (os/arch) where uname -m cannot "
                         "say; picks the image of a multi-platform render"),
    "RESULTSDIR": ("all", "logs, results and each job's ran_in.json (recipes.results_dir)"),
    "DATADIR": ("run.sub", "the prepared shards (recipes.data_dir)"),
    "DATAPATH": ("dataset.sub", "where dataset.sub writes the shards (recipes.data_dir)"),
    "CHECKPOINTDIR": ("run.sub", "checkpoints (recipes.checkpoint_dir)"),
    "BERT_CONFIG": ("run.sub", "a host file with the model's config (default: the image's "
                    "BERT-Large)"),
    "VOCAB": ("run.sub, dataset.sub", "the WordPiece vocabulary (recipes.vocab)"),
    "SOURCE": ("dataset.sub", "the raw text to prepare (recipes.dataset_source)"),
    "SHARDS": ("dataset.sub", "how many HDF5 shards to write"),
    "SEED": ("dataset.sub", "the instance-creation seed (12345)"),
    "BATCHSIZE": ("run.sub", "per-GPU batch after accumulation (from config_*.sh)"),
    "GRADIENT_STEPS": ("run.sub", "gradient accumulation steps (from config_*.sh)"),
    "PHASE": ("run.sub", "1 (sequence 128) or 2 (sequence 512) (from config_*.sh)"),
    "MAX_STEPS": ("run.sub", "optimizer steps of the phase (from config_*.sh)"),
    "WARMUP_PROPORTION": ("run.sub", "the learning rate's warm-up share (from config_*.sh)"),
    "LR": ("run.sub", "the learning rate (from config_*.sh)"),
    "DGXNNODES": ("run.sub", "the nodes the config was made for (from config_*.sh)"),
    "DGXNGPU": ("run.sub", "the GPUs per node the config was made for (from config_*.sh)"),
    "INIT_CHECKPOINT": ("run.sub", "weights to start from: a phase 1 checkpoint, a Hugging "
                        "Face folder or an NVIDIA checkpoint (phase 1 too: continued "
                        "pre-training)"),
    "TRUST_CHECKPOINT": ("run.sub", "switch: on (1, yes, true) lets INIT_CHECKPOINT hold "
                         "pickled Python objects (NVIDIA's 2020-2022 checkpoints); off (0, no, "
                         "false, empty, unset) refuses them"),
    "EXPORT": ("run.sub", "hf or nvidia: after phase 2, export the model in that layout; off "
               "(0, no, false, empty, unset): no export; anything else ends the job before "
               "training"),
    "LOG_FREQ": ("run.sub", "optimizer steps per log line"),
    "CHECKPOINT_EVERY": ("run.sub", "optimizer steps between checkpoints"),
    "COMPRESSION": ("dataset.sub", "the shards' HDF5 compression: gzip (default), lzf or "
                    "none"),
    "SELFTEST": ("run.sub", "switch: on (1, yes, true) runs the image's self-test on every "
                 "node, then trains; only: the self-test and nothing else; off (0, no, false, "
                 "empty, unset): straight to training"),
    "PYTHON": ("run.sub", "the Python in the image (host runtime)"),
    "BENCH": ("nccl.sub", "all_reduce_perf (nccl-tests) or pytorch (the all-reduce benchmark "
              "in the bert image)"),
    "MAX_BYTES": ("nccl.sub", "the largest message size of the NCCL sweep"),
    "SRUN_MPI": ("nccl.sub", "srun's --mpi for nccl-tests' MPI ranks (pmix)"),
    "NCCL_DEBUG": ("nccl.sub", "NCCL's log level (INFO: the transport each rank uses)"),
    "NCCL_DEBUG_SUBSYS": ("nccl.sub", "NCCL's log subsystems (INIT,NET)"),
    "IMGPIPE_IMPORTER": ("all (node-local caches)", "the importer stage_image runs on the "
                         "batch host and every node (enroot.importer_path)"),
    "IMGPIPE_DISTRIBUTION": ("all (node-local caches)", "sbcast or broadcast, anything else "
                             "for fetch: how stage_image gets the image onto the nodes; read "
                             "only by scripts rendered for a node-local enroot.distribution"),
    "IMGPIPE_SBCAST": ("all (node-local caches)", "the sbcast program (default: sbcast on "
                       "PATH); missing or failing: one line, and each other node fetches, "
                       "saying so"),
    "IMGPIPE_SBCAST_FANOUT": ("all (node-local caches)", "sbcast's tree width "
                              "(enroot.sbcast_fanout)"),
    "IMGPIPE_SBCAST_BLOCK": ("all (node-local caches)", "sbcast's block size "
                             "(enroot.sbcast_block)"),
}
IMPORTER_ENVIRONMENT: dict[str, str] = {
    "IMGPIPE_CONFIG": "the one config file the importer reads (default "
                      "/etc/imgpipe/imgpipe.yaml)",
    "IMGPIPE_SQUASHFS_PINS": "published squashfs digests this job trusts, IMAGE=SQUASHFS "
                             "pairs (the recipes export it from imgpipe.lock)",
    "IMGPIPE_PLATFORM": "this node's platform where uname -m cannot say",
    "PYXIS_RUNTIME_PATH": "Pyxis's runtime_path (Pyxis sets it): another registry's image "
                          "is imported into PYXIS_RUNTIME_PATH/UID, as Pyxis itself would, and "
                          "the step record goes there too",
    "XDG_RUNTIME_DIR": "where the step record goes outside Pyxis (else ~/.cache/imgpipe)",
    "SLURM_JOB_ID, SLURM_STEP_ID": "name the step's record and use markers (Slurm sets them)",
    "ENROOT_*": "passed to `enroot import` for another registry's image, as Pyxis passes them",
}
SLURM_SET = re.compile(r"^(SLURM_\w+|X)$")


def template_variables() -> set[str]:
    """The variables the job scripts read with a default or require (Slurm's left out)."""
    import inspect

    from imgpipe.recipes import render, runtimes, staging  # the shell of the scripts

    texts = [inspect.getsource(render), inspect.getsource(runtimes),
             inspect.getsource(staging)]
    for template in ("run.sub.j2", "dataset.sub.j2", "nccl.sub.j2", "config.sh.j2"):
        texts.append(resources.files("imgpipe.recipes").joinpath("templates",
                                                                  template).read_text())
    found: set[str] = set()
    for text in texts:
        found |= set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):[-?]", text))
    return {name for name in found if not SLURM_SET.match(name)}


def environment_page() -> str:
    lines = [GENERATED, "# Environment", "",
             "## The job scripts", "",
             "`run.sub`, `dataset.sub` and `nccl.sub` read these when set (`sbatch --export` "
             "or exported before `sbatch`); a `config_*.sh` file sets the shape's. The "
             "defaults are what `imgpipe recipes render` wrote in.", "",
             "| variable | read by | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {scripts} | {_cell(text)} |"
              for name, (scripts, text) in ENVIRONMENT.items()]
    lines += ["", "## The Pyxis importer", "", "| variable | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(text)} |" for name, text in IMPORTER_ENVIRONMENT.items()]
    return "\n".join(lines) + "\n"
