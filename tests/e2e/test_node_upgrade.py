"""A new imgpipe on the nodes, and imgpipe taken off them, while users' Pyxis jobs run (Pyxis
0.24 and Enroot 4.1.2 on a 2-host sandbox, whose plugstack line names the importer link
`node-config` manages, /usr/local/bin/imgpipe-pyxis-importer).

Upgrade: a second imgpipe venv beside the first, `node-config --upgrade --venv NEW` while one
job sleeps in its container and another's importer converts: both finish, the sleeping job's
step ends on the new importer (which reads the old one's record), and the next job runs the
new one (the old one is made unrunnable for job users after the swap, so a job that ran it
would fail).  Removal: `node-config --remove --root R` on a node image whose squashfs folder
a running job uses: the entry in use is kept and named, the rest goes, the site's own files
stay byte for byte, and the job ends well."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster import SYSTEM_VENV, USERS, ensure_users, shared_folder, system_imgpipe
from tests.nodeimage import node_image, sums
from tests.published_image import ci_publish, hello_origin

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ALICE, BOB = USERS
LINK = Path("/usr/local/bin/imgpipe-pyxis-importer")
NEW_VENV = SYSTEM_VENV.parent / "venv-new"
IMGPIPE = str(Path(sys.executable).parent / "imgpipe")


def _second_venv(old: Path) -> Path:
    """imgpipe installed again beside ``old`` (its dependencies read from ``old``'s site
    packages): what an admin's new version is."""
    subprocess.run(["rm", "-rf", str(NEW_VENV)], check=True)
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(NEW_VENV)], check=True,
                   capture_output=True)
    [site] = (NEW_VENV / "lib").glob("python3*/site-packages")
    [old_site] = (old.parent / "lib").glob("python3*/site-packages")
    (site / "imgpipe-old-deps.pth").write_text(f"{old_site}\n")
    build = shared_folder("imgpipe-new-wheel-")
    subprocess.run([str(NEW_VENV / "bin/python"), "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", str(REPO)],
                   check=True, capture_output=True, timeout=300,
                   env={**os.environ, "TMPDIR": str(build)})
    subprocess.run(["chmod", "-R", "a+rX", str(NEW_VENV)], check=True)
    return NEW_VENV


@pytest.fixture(scope="module")
def upgrade_site(registry_server, base_image: str, tmp_path_factory: pytest.TempPathFactory):
    """The importer link in place (naming the first venv), a Pyxis sandbox whose plugstack
    line names the link, a node image R with its own site files, and the hello image."""
    from imgpipe.commands.builds.sandbox import with_pyxis
    from imgpipe.recipes.sandbox import SandboxSpec, running

    ensure_users()
    old = system_imgpipe(REPO)
    new = _second_venv(old)
    if os.path.lexists(LINK) and not os.readlink(LINK).startswith(str(SYSTEM_VENV.parent)):
        pytest.fail(f"{LINK} is this machine's own: the test would replace it")
    backups = Path("/var/lib/imgpipe/backups")
    before = set(backups.iterdir()) if backups.is_dir() else set()
    origin = hello_origin(tmp_path_factory.mktemp("upgrade-origin"), registry_server.port,
                          "upgrade/hello")
    published = ci_publish(origin, tmp_path_factory.mktemp("upgrade-ci") / "a")
    node = shared_folder("imgpipe-upgrade-node-")
    cache = node / "var/cache/imgpipe"
    config = node / "etc/imgpipe/imgpipe.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(yaml.safe_dump({"registry": {"host": "head", "port": 5000},
                                      "outputs": {"squashfs_dir": "/var/cache/imgpipe"}}))
    jobs = node / "jobs.yaml"  # what the jobs read: the same folder, by its host path
    jobs.write_text(yaml.safe_dump({"registry": {"host": "head", "port": 5000},
                                    "outputs": {"squashfs_dir": str(cache)}}))
    for path in (config, jobs):
        path.chmod(0o644)
    made = subprocess.run([IMGPIPE, "node-config", "--make-cache", str(cache)],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    first = subprocess.run([IMGPIPE, "--config", str(jobs), "node-config", "--upgrade",
                            "--venv", str(old.parent)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    spec = with_pyxis(SandboxSpec(shared_folder("imgpipe-upgrade-"), name="imgup",
                                  subnet="10.213.23", compute_nodes=2, cpus=4, gpus=0),
                      importer=str(LINK))
    try:
        with running(spec, registry_storage=registry_server.root / "data") as sandbox:
            yield {"cluster": sandbox, "old": old.parent, "new": new, "node": node,
                   "cache": cache, "jobs": jobs,
                   "uri": f"head:5000#upgrade/hello@{published['digest']}"}
    finally:
        (old / "imgpipe-pyxis-importer").chmod(0o755)
        if LINK.is_symlink():
            LINK.unlink()
        for run in set(backups.iterdir()) - before if backups.is_dir() else ():
            subprocess.run(["rm", "-rf", str(run)], check=False)


def _job(site: dict, user: str, program: str, node: str, marks: Path | None = None
         ) -> subprocess.Popen[str]:
    """``program`` in a container step of ``user`` on ``node`` (``marks`` at /marks)."""
    mounts = [f"--container-mounts={marks}:/marks"] if marks else []
    argv = site["cluster"].on(None, ["srun", "-N1", "-w", node, *mounts,
                                     f"--container-image={site['uri']}", "/bin/sh", "-c",
                                     program], user, {"IMGPIPE_CONFIG": str(site["jobs"])})
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd="/tmp")


def _wait_for(path: Path, job: subprocess.Popen[str], timeout: float = 300) -> None:
    """Until the job's container step has made ``path`` (its output, if it ended first)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if job.poll() is not None:
            out, err = job.communicate()
            pytest.fail(f"the job ended ({job.returncode}) before {path}: {out}{err}")
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.2)


def _upgrade(site: dict, venv: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([IMGPIPE, "--config", str(site["jobs"]), "node-config", "--upgrade",
                           "--venv", str(venv)], capture_output=True, text=True)


def test_an_upgrade_while_jobs_run_fails_none_and_the_next_job_runs_the_new_one(
        upgrade_site: dict) -> None:
    site = upgrade_site
    marks = shared_folder("imgpipe-upgrade-marks-")
    os.chmod(marks, 0o777)
    sleeping = _job(site, ALICE, "touch /marks/a; sleep 12; cat /hello.txt", "node1", marks)
    _wait_for(marks / "a", sleeping)
    uses = site["cache"] / ".imgpipe" / "uses"
    assert [m for m in uses.iterdir() if f"~{_uid(ALICE)}~" in m.name]  # the step's use
    converting = _job(site, BOB, "cat /hello.txt", "node2")  # Bob's own conversion
    swapped = _upgrade(site, site["new"])
    assert swapped.returncode == 0, swapped.stderr
    assert f"linked {LINK} -> {site['new']}/bin/imgpipe-pyxis-importer" in swapped.stdout
    assert f"(was {site['old']}/bin/imgpipe-pyxis-importer)" in swapped.stdout
    # from now on no job user can run the old importer (a running one goes on)
    (site["old"] / "bin/imgpipe-pyxis-importer").chmod(0o700)
    for job, user in ((sleeping, ALICE), (converting, BOB)):
        out, err = job.communicate(timeout=600)
        assert job.returncode == 0, f"{user}: {out}{err}"
        assert "hello from CI" in out
    # the sleeping step ended on the new importer: its use of the entry is over
    assert not [m for m in uses.iterdir() if f"~{_uid(ALICE)}~" in m.name], list(uses.iterdir())
    after = _job(site, ALICE, "cat /hello.txt", "node2")
    out, err = after.communicate(timeout=600)
    assert after.returncode == 0 and "hello from CI" in out, out + err
    again = _upgrade(site, site["new"])
    assert again.returncode == 0 and "nothing to do" in again.stdout


def test_removal_while_a_job_runs_keeps_its_entry_and_the_sites_files(
        upgrade_site: dict) -> None:
    site = upgrade_site
    node = site["node"]
    pyxis = "required /usr/local/lib/slurm/spank_pyxis.so runtime_path=/run/pyxis"
    node_image(node, {"etc/slurm/slurm.conf": "ClusterName=site\n"
                                              "PlugStackConfig=/etc/slurm/plug.conf\n",
                      "etc/slurm/plug.conf": f"# the site's own\n{pyxis}\n"},
               "usr/local/lib/slurm/spank_pyxis.so")
    site_files = {k: v for k, v in sums(node).items() if not k.startswith(("var", "etc/imgpipe"))}
    applied = subprocess.run([IMGPIPE, "node-config", "--apply", "--accept", "importer",
                              "--root", str(node)], capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    assert "importer=/usr/local/bin/imgpipe-pyxis-importer" in (
        node / "etc/slurm/plug.conf").read_text(), applied.stdout
    assert (node / "usr/local/bin/imgpipe-pyxis-importer").is_symlink()
    marks = shared_folder("imgpipe-remove-marks-")
    os.chmod(marks, 0o777)
    running = _job(site, BOB, "touch /marks/b; sleep 8; cat /hello.txt", "node1", marks)
    _wait_for(marks / "b", running)
    entries = sorted(site["cache"].glob("*.sqsh"))
    assert entries
    removed = subprocess.run([IMGPIPE, "node-config", "--remove", "--root", str(node),
                              "--json"], capture_output=True, text=True)
    assert removed.returncode == 0, removed.stderr
    data = json.loads(removed.stdout)["data"]
    in_use = [line for line in data["kept"] if ": in use (" in line]
    assert len(in_use) == 1 and f"{_uid(BOB)}" in in_use[0], data
    [kept] = [e for e in entries if str(e) in in_use[0]]
    assert kept.exists() and [e for e in entries if e.exists()] == [kept]
    out, err = running.communicate(timeout=600)
    assert running.returncode == 0 and "hello from CI" in out, out + err
    after = {k: v for k, v in sums(node).items() if not k.startswith(("var", "etc/imgpipe"))}
    assert after == site_files  # the site's plugstack, byte for byte
    assert not (node / "etc/imgpipe/imgpipe.yaml").exists()
    assert not os.path.lexists(node / "usr/local/bin/imgpipe-pyxis-importer")


def _uid(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_uid
