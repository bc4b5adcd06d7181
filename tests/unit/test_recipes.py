"""Recipes: scaling keeps the global batch, scripts pass shellcheck, hostile values cannot inject.

Running the jobs on a real Slurm is the next step of the recipes issue; these
tests cover what rendering promises on its own.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from imgpipe.recipes.errors import RecipeError, ShapeError
from imgpipe.recipes.profiles import SHIPPED, load_profile
from imgpipe.recipes.render import RecipeInputs, render_bundle
from imgpipe.recipes.scaling import shape_for, table

PINNED = "head:5000/imgpipe/bert@sha256:" + "ab" * 32


@pytest.mark.parametrize("name", ["dgx1", "dgx2"])
@pytest.mark.parametrize("nodes", [1, 4, 16])
@pytest.mark.parametrize("phase", [1, 2])
def test_global_batch_is_kept(name: str, nodes: int, phase: int) -> None:
    profile = load_profile(name)
    shape = shape_for(profile, nodes, phase)
    assert shape.global_batch == (65536 if phase == 1 else 32768)
    assert shape.accumulation * shape.micro_batch * shape.gpus == shape.global_batch
    assert shape.per_gpu_batch * shape.gpus == shape.global_batch
    assert shape.learning_rate == (6e-3 if phase == 1 else 4e-3)
    assert shape.seq_len == (128 if phase == 1 else 512)


def test_facts_reference_points() -> None:
    # 16 GB V100 holds 16 sequences at 128 and 4 at 512; 32 GB holds 64 and 8.
    assert shape_for(load_profile("dgx1"), 1, 1).micro_batch == 16
    assert shape_for(load_profile("dgx1"), 1, 2).micro_batch == 4
    assert shape_for(load_profile("dgx2"), 1, 1).micro_batch == 64
    assert shape_for(load_profile("dgx2"), 1, 2).micro_batch == 8
    sixteen = shape_for(load_profile("dgx1"), 16, 1)
    assert (sixteen.per_gpu_batch, sixteen.accumulation) == (512, 32)


def test_shapes_that_cannot_keep_the_batch_are_refused() -> None:
    with pytest.raises(ShapeError, match="24 GPUs, which do not divide the global batch 65536"):
        shape_for(load_profile("dgx1"), 3, 1)


def test_table_matches_rendered_configs(tmp_path: Path, cli) -> None:
    code, out, _ = cli("recipes", "table", "--profile", "dgx2", "--max-nodes", "16", "--json")
    assert code == 0
    rows = json.loads(out)["data"]["shapes"]
    assert {r["nodes"] for r in rows} == {1, 2, 4, 8, 16}
    for row in rows:
        if row["nodes"] not in (1, 4, 16):
            continue
        folder = tmp_path / f"n{row['nodes']}"
        code, _, err = cli("recipes", "render", "--profile", "dgx2", "--nodes",
                           str(row["nodes"]), "--phase", str(row["phase"]), "--image", PINNED,
                           "-o", str(folder))
        assert code == 0, err
        config = (folder / row["config_name"]).read_text()
        exported = dict(line.removeprefix("export ").split("=", 1)
                        for line in config.splitlines() if line.startswith("export "))
        assert exported["BATCHSIZE"] == str(row["per_gpu_batch"])
        assert exported["GRADIENT_STEPS"] == str(row["accumulation"])
        assert exported["DGXNNODES"] == str(row["nodes"])
        assert exported["DGXNGPU"] == "16"
        assert exported["PHASE"] == str(row["phase"])
        assert float(exported["LR"]) == row["learning_rate"]


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("runtime", ["pyxis", "host"])
def test_every_rendered_script_passes_shellcheck(tmp_path: Path, name: str,
                                                 runtime: str) -> None:
    profile = load_profile(name)
    nodes = 1 if name == "local" else 2
    bundle = render_bundle(RecipeInputs(profile, nodes, PINNED, runtime=runtime), tmp_path)
    scripts = [p for p in bundle.files if p.suffix in (".sub", ".sh")]
    assert len(scripts) == 5
    result = subprocess.run(["shellcheck", "--severity=style", *map(str, scripts)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    run_sub = (tmp_path / "run.sub").read_text()
    assert "#SBATCH" in run_sub
    for line in run_sub.splitlines():
        if line.startswith("#SBATCH"):
            assert "#" not in line[1:], line  # Enroot's '#' form never reaches #SBATCH


def test_image_is_pinned_in_enroot_form() -> None:
    assert "head:5000#imgpipe/bert@sha256:" in _render_text(image=PINNED)
    with pytest.raises(RecipeError, match="not pinned to a digest"):
        _render_text(image="head:5000/imgpipe/bert:latest")


def _render_text(tmp: Path | None = None, **changes) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        inputs = RecipeInputs(load_profile("local"), 1, changes.pop("image", PINNED),
                              runtime="host", **changes)
        render_bundle(inputs, Path(folder))
        return "".join(p.read_text() for p in sorted(Path(folder).iterdir()))


MARKER = f"/tmp/imgpipe-pwned-{os.getpid()}"  # created only if an injection ran
HOSTILE = [
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f"a b; touch {MARKER}",
    "it's \"quoted\"",
    f"line1\nline2; touch {MARKER}",
    f"${{HOME}}/x && touch {MARKER}",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_environment_values_are_quoted(value: str, tmp_path: Path) -> None:
    bundle = render_bundle(RecipeInputs(load_profile("local"), 1, PINNED, runtime="host",
                                        env={"SITE_VALUE": value}), tmp_path)
    script = tmp_path / "run.sub"
    assert bundle.files
    line = next(x for x in script.read_text().split("\nexport ") if x.startswith("SITE_VALUE="))
    assignment = "export " + line.split("\nexport ")[0]
    probe = subprocess.run(["bash", "-c", assignment.split("\n\n")[0]
                            + '\nprintf %s "$SITE_VALUE"'], capture_output=True, text=True)
    assert probe.stdout == value  # the shell reads it back unchanged
    assert not Path(MARKER).exists()


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_paths_are_quoted_or_refused(value: str, tmp_path: Path) -> None:
    try:
        render_bundle(RecipeInputs(load_profile("local"), 1, PINNED, runtime="host",
                                   data_dir=value), tmp_path)
    except RecipeError as exc:
        assert "\n" in value and "not a usable path" in exc.message
        return
    script = (tmp_path / "run.sub").read_text()
    assert f"default_datadir={shlex.quote(value)}\n" in script
    probe = subprocess.run(
        ["bash", "-c", f'default_datadir={shlex.quote(value)}\n'
         'DATADIR="${DATADIR:-$default_datadir}"; printf %s "$DATADIR"'],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert probe.stdout == value
    assert not Path(MARKER).exists()


@pytest.mark.parametrize("value", ["debug; rm -rf /", "batch\n#SBATCH --uid=0", "a b",
                                   "$(id)", "`id`", "x#y"])
def test_hostile_sbatch_values_are_refused(value: str, tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="cannot go in an #SBATCH line"):
        render_bundle(RecipeInputs(load_profile("local"), 1, PINNED, partition=value),
                      tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize("image", ["head:5000/bert@sha256:zz", "$(id)", "a b",
                                   "/path/with\nnewline.sqsh"])
def test_hostile_images_are_refused(image: str, tmp_path: Path) -> None:
    with pytest.raises(RecipeError):
        render_bundle(RecipeInputs(load_profile("local"), 1, image), tmp_path)


def test_hostile_env_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="not a valid shell variable"):
        render_bundle(RecipeInputs(load_profile("local"), 1, PINNED,
                                   env={"A;touch x": "1"}), tmp_path)


def test_render_without_a_pushed_image_says_how(cli) -> None:
    code, _, err = cli("recipes", "render", "--profile", "local", "--nodes", "1")
    assert code == 2
    assert "imgpipe.lock has no pushed bert/cpu to pin" in err


def test_unknown_profile_and_bad_shape_exit_2(cli) -> None:
    code, _, err = cli("recipes", "table", "--profile", "dgx9")
    assert code == 2 and "unknown profile 'dgx9'" in err
    code, _, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "3", "--image",
                       PINNED)
    assert code == 2 and "do not divide the global batch" in err


def test_table_lists_only_shapes_that_keep_the_batch() -> None:
    shapes = table(load_profile("dgx-h100"), 64)
    assert shapes and all(s.global_batch % s.gpus == 0 for s in shapes)


def test_site_paths_from_the_config_reach_the_scripts(cli, tmp_path: Path) -> None:
    cli.write_config({"recipes": {"bert_config": "/site/models/bert base.json",
                                  "data_dir": "/site/data"}})
    code, _, err = cli("recipes", "render", "--profile", "dgx1", "--nodes", "1", "--image",
                       PINNED, "-o", str(tmp_path))
    assert code == 0, err
    script = (tmp_path / "run.sub").read_text()
    assert "default_bert_config='/site/models/bert base.json'" in script
    assert "default_datadir=/site/data" in script
