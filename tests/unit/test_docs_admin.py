"""What an admin reads, checked against what runs (issue #54's classes of wrong sentences):

- every variable of docs/reference/environment.md is one a job script reads, every one a script
  reads is there, and every switch is run both ways with each value the page documents;
- the images workflow that runs is the one docs/images.md describes;
- the `--accept` names of the admin guide are the ones node-config takes, and what the guide
  says `node-config --apply` writes is what tests/e2e/test_first_hour.py sees it write;
- the exit codes the pages list are the ones `imgpipe` returns.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from imgpipe.commands.builds.reference import (
    ENVIRONMENT,
    IMPORTER_ENVIRONMENT,
    template_variables,
)
from imgpipe.recipes.profiles import load_profile
from imgpipe.recipes.render import RecipeInputs, render_bundle

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRUN = '#!/bin/bash\nn=$(ls "$RECORD" | wc -l)\nprintf "%s\\0" "$@" > "$RECORD/$n"\n'


def _page_rows() -> dict[str, str]:
    page = (DOCS / "reference" / "environment.md").read_text().split("## The Pyxis importer")[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| [^|]+ \| (.+) \|$",
                                                         page, re.MULTILINE)}


def test_every_documented_variable_is_read_and_every_read_one_documented() -> None:
    """The reference said COMPRESSION was run.sub's squashfs compression: no script read it
    that way (dataset.sub's HDF5 compression is what it is)."""
    read = template_variables()
    assert set(ENVIRONMENT) - read == set(), "documented, read by no job script"
    assert read - set(ENVIRONMENT) - set(IMPORTER_ENVIRONMENT) == set(), \
        "read by a job script, not documented"
    assert set(_page_rows()) == set(ENVIRONMENT)
    dataset = (ROOT / "recipes" / "templates" / "dataset.sub.j2").read_text()
    assert "${COMPRESSION" in dataset and ENVIRONMENT["COMPRESSION"][0] == "dataset.sub"


def _values(meaning: str, word: str) -> list[str]:
    """The values a switch's meaning lists after ``word`` ("on (1, yes, true)")."""
    match = re.search(rf"\b{word} \(([^)]*)\)", meaning)
    assert match, meaning
    return ["" if v.strip() in ("empty", "unset") else v.strip()
            for v in match.group(1).split(",")]


def _run_sub(tmp_path: Path, env: dict[str, str]) -> tuple[int, list[list[str]], str]:
    """run.sub (phase 2, Pyxis) run by bash with a recording srun: (status, each srun argv)."""
    for name in ("bin", "record", "data", "ckpt", "results", "init"):
        (tmp_path / name).mkdir(exist_ok=True)
    for tool in ("srun", "scontrol"):
        (tmp_path / "bin" / tool).write_text(SRUN)
        (tmp_path / "bin" / tool).chmod(0o755)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n")
    folder = tmp_path / "recipes"
    if not folder.exists():
        bundle = render_bundle(RecipeInputs(
            load_profile("local"), 2, "/images/bert.sqsh", data_dir=str(tmp_path / "data"),
            checkpoint_dir=str(tmp_path / "ckpt"), results_dir=str(tmp_path / "results"),
            vocab=str(vocab), selftest=("python3", "-m", "bert_trainer.selftest")), folder)
        (tmp_path / "config").write_text(bundle.shapes[1].config_name)
    config = folder / (tmp_path / "config").read_text()
    for old in (tmp_path / "record").iterdir():
        old.unlink()
    done = subprocess.run(["bash", "-c", f"source {config} && bash {folder / 'run.sub'}"],
                          capture_output=True, text=True, timeout=60, env={
                              "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
                              "RECORD": str(tmp_path / "record"), "SLURM_JOB_ID": "7",
                              "SLURM_JOB_NAME": "bert", "SLURM_JOB_NUM_NODES": "2",
                              "SLURM_NTASKS": "4", **env})
    record = tmp_path / "record"
    calls = [(record / str(i)).read_bytes().decode().split("\0")[:-1]
             for i in range(len(list(record.iterdir())))]
    return done.returncode, calls, done.stderr


def _trusts(tmp_path: Path, value: str) -> bool:
    code, calls, err = _run_sub(tmp_path, {"TRUST_CHECKPOINT": value,
                                           "INIT_CHECKPOINT": str(tmp_path / "init")})
    assert code == 0, err
    return any("--trust_checkpoint" in call for call in calls)


def _self_tests(tmp_path: Path, value: str) -> bool:
    code, calls, err = _run_sub(tmp_path, {"SELFTEST": value})
    assert code == 0, err
    return any("bert_trainer.selftest" in call for call in calls)


def _exports(tmp_path: Path, value: str) -> bool:
    code, calls, err = _run_sub(tmp_path, {"EXPORT": value})
    assert code == 0, err
    return any("bert_trainer.export" in call for call in calls)


EFFECTS = {"TRUST_CHECKPOINT": _trusts, "SELFTEST": _self_tests}


@pytest.mark.parametrize("name", sorted(EFFECTS))
def test_every_switch_means_what_the_page_says_both_ways(tmp_path: Path, name: str) -> None:
    """Before, TRUST_CHECKPOINT=0 turned loading pickled objects ON and SELFTEST=0 ran the
    self-test: any non-empty value counted."""
    meaning = _page_rows()[name]
    assert meaning.startswith("switch:"), meaning
    for value in _values(meaning, "on"):
        assert EFFECTS[name](tmp_path, value), f"{name}={value!r} should turn it on"
        assert EFFECTS[name](tmp_path, value.upper()), f"{name}={value.upper()!r}"
    for value in _values(meaning, "off"):
        assert not EFFECTS[name](tmp_path, value), f"{name}={value!r} should turn it off"


def test_every_switch_of_the_page_is_tried_here() -> None:
    switches = {name for name, meaning in _page_rows().items() if meaning.startswith("switch:")}
    assert switches == set(EFFECTS)


def test_export_is_off_as_documented_and_a_wrong_layout_ends_the_job_before_training(
        tmp_path: Path) -> None:
    meaning = _page_rows()["EXPORT"]
    for value in _values(meaning, "off"):
        assert not _exports(tmp_path, value), value
    assert _exports(tmp_path, "hf") and _exports(tmp_path, "nvidia")
    code, calls, err = _run_sub(tmp_path, {"EXPORT": "onnx"})
    assert code == 2 and calls == [] and "EXPORT must be hf or nvidia" in err


def _ci_section() -> str:
    page = (DOCS / "images.md").read_text()
    return page.split("## CI on a head node", 1)[1].split("\n## ", 1)[0]


def test_the_workflow_that_runs_is_the_one_the_images_page_describes() -> None:
    """Before, the page described a per-merge script while the workflow ran ./setup.sh
    install (apt, binfmt) and imgpipe ci."""
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "images.yml").read_text())
    [job] = workflow["jobs"].values()
    section = _ci_section()
    runs = [step["run"] for step in job["steps"] if "run" in step]
    assert runs and all(run.startswith(".github/per-merge.sh ") for run in runs), runs
    assert "setup.sh" not in " ".join(runs)
    for step in job["steps"]:
        if "uses" in step:
            assert step["uses"].split("@")[0] in section, step["uses"]
        for value in [step.get("run", ""), *dict(step.get("env") or {}).values()]:
            for _kind, name, default in re.findall(
                    r"\$\{\{\s*(vars|secrets)\.(\w+)(?:\s*\|\|\s*'([^']*)')?\s*\}\}", value):
                assert f"`{name}`" in section, name
                if default:
                    assert f"`{default}`" in section, (name, default)
    script = (ROOT / ".github" / "per-merge.sh").read_text()
    for needed in re.findall(r'\$\{(IMGPIPE_\w+):\?', script):
        assert f"`{needed}`" in section, needed
    assert "apt" not in script.replace("no apt", "") and "sudo" not in script


def test_the_accept_names_of_the_guide_are_the_ones_node_config_takes() -> None:
    from imgpipe.enroot.nodeconfig import ACCEPTED_NAMES

    guide = (DOCS / "admin.md").read_text()
    table = guide.split("| `--accept` | what it writes | what it changes |", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \|", table.split("\n\n", 1)[0], re.MULTILINE)
    assert rows == list(ACCEPTED_NAMES)


def test_what_the_guide_says_apply_writes_is_what_the_first_hour_test_sees() -> None:
    """The guide: --apply writes imgpipe's own files and, accepted, the Pyxis line; the
    first-hour test asserts the site's files that changed are exactly the accepted line's."""
    guide = " ".join((DOCS / "admin.md").read_text().split())
    assert "`--apply` writes imgpipe's own files without asking: the site config" in guide
    assert "and the importer link in `/usr/local/bin`" in guide
    first_hour = (ROOT / "tests" / "e2e" / "test_first_hour.py").read_text()
    assert 'assert changed == {"etc/slurm/plugstack.conf"}' in first_hour
    assert '"ACCEPT": "importer"' in first_hour
    assert "/etc/imgpipe/imgpipe.yaml" in guide and "/usr/local/bin" in guide


def test_the_exit_codes_listed_are_the_ones_imgpipe_returns() -> None:
    main = (ROOT / "cli" / "main.py").read_text()
    returned = {int(code) for code in re.findall(r"return (\d{3})\b", main)}
    assert returned >= {130, 143}, returned
    for page in ("README.md", "docs/index.md", "docs/commands.md",
                 "docs/reference/commands.md"):
        text = (ROOT / page).read_text().replace("\n", " ")
        for code in returned:
            assert f"{code} " in text, (page, code)


def test_every_config_example_of_the_docs_can_work_as_written() -> None:
    """docs/configuration.md's example combined squashfuse: true (nodes ask for lz4) with
    publish_compressions: [zstd]: every node would have converted, silently."""
    from pydantic import ValidationError

    from imgpipe.base.config import Settings
    from imgpipe.base.configcheck import conflicts

    checked = 0
    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.DOTALL):
            try:
                values = yaml.safe_load(block)
                settings = Settings.model_validate(values)
            except (yaml.YAMLError, ValidationError, TypeError, ValueError):
                continue  # an image.yaml, a profile, a fragment of another file
            checked += 1
            found = [line for line in conflicts(settings)
                     if not line.startswith("registry.server.data_dir")]
            assert found == [], (page.name, block[:200], found)
    assert checked >= 3
