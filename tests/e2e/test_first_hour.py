"""The admin guide's first hour (docs/first-hour.sh, the script docs/admin.md shows), run as
written on the sandbox cluster set up as an existing site.

The site has its own files before imgpipe comes: a node image with its own enroot.conf,
environ.d and Pyxis line (Pyxis 0.24) in a plugstack.conf with no plugstack.conf.d, a partition
named `debug`, a CPU profile that is no DGX.  imgpipe reaches the nodes as the guide says: the
wheels `./setup.sh node-wheels` makes, installed into a venv of the system Python (the node
image holds imgpipe in /opt/imgpipe, where its importer link points).  The script then writes
the site config in /etc, checks and applies the nodes' config (the importer accepted), sets the
shared cache up, checks the profile against the node, renders the recipes as a user and runs
the NCCL check and the report.  Afterwards the site's own files are as they were, except the
Pyxis line the admin accepted, which is kept in a backup.

The site's jobs run through real Pyxis (0.24.0, built by ./setup.sh) on a sandbox whose
slurmd reads the node image's own plugstack.conf, and whose compute hosts see the node
image's /usr/local/bin (Enroot, and the importer link node-config makes) and /opt (imgpipe as
the guide installs it) in place of their own.  So the NCCL job is the site's user's `srun
--container-image=head:5000#imgpipe/bert@sha256:…` on the accepted importer line; then
`node-config --rollback` puts the site's line back and the same job runs through Enroot's
own import again (Enroot's per-user layer cache on the nodes shows it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster import USERS, owned_by, shared_folder
from tests.nodeimage import node_image, sums

ROOT = Path(__file__).resolve().parents[2]
ALICE = USERS[0]
SITE_CONFIG = Path("/etc/imgpipe")
PLUGIN = "usr/local/lib/slurm/spank_pyxis.so"  # where ./setup.sh installs the real one
PYXIS = (f"required /{PLUGIN} runtime_path=/run/pyxis container_scope=job sbatch_support=1")
SITE_FILES = {
    "etc/slurm/slurm.conf": "ClusterName=site\nPartitionName=debug Nodes=ALL\n",
    "etc/slurm/plugstack.conf": "optional /usr/lib/site/spank_x11.so\n" + PYXIS + "\n",
    "etc/enroot/enroot.conf": "ENROOT_RUNTIME_PATH /run/enroot/user-$(id -u)\n"
                              "ENROOT_SQUASH_OPTIONS -comp lzo -noD\n",
    "etc/enroot/environ.d/50-site.env": "NCCL_SOCKET_IFNAME=ib0\n",
}

pytestmark = pytest.mark.slow


@pytest.fixture
def site_etc() -> Iterator[None]:
    """/etc/imgpipe as the site left it before the test, put back after."""
    kept = SITE_CONFIG.with_name("imgpipe.first-hour-test")
    if SITE_CONFIG.exists():
        SITE_CONFIG.rename(kept)
    try:
        yield
    finally:
        shutil.rmtree(SITE_CONFIG, ignore_errors=True)
        if kept.exists():
            kept.rename(SITE_CONFIG)


@pytest.fixture(scope="module")
def node_install() -> tuple[Path, Path]:
    """imgpipe as the guide installs it on a node: `./setup.sh node-wheels` in a checkout,
    then a venv of the system Python, from those wheels alone, every user can run.  The
    checkout and the venv (shared by this file's tests: each takes its own copy of the
    checkout as the user's clone)."""
    work = shared_folder("imgpipe-first-hour-install-")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        "build", ".venv", ".git", "__pycache__", "*.egg-info", "dist"))
    python = "/usr/bin/python3"
    subprocess.run(["bash", "setup.sh", "node-wheels"], check=True, capture_output=True,
                   timeout=900, cwd=source, env={"PATH": "/usr/bin:/bin", "PYTHON": python,
                                                 "HOME": str(work)})
    venv = work / "opt-imgpipe"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links",
                    str(source / "dist" / "nodes" / "x86_64"), "imgpipe"], check=True,
                   capture_output=True, timeout=900)
    subprocess.run(["chmod", "-R", "a+rX", str(work)], check=True)
    return source, venv


def _clone(source: Path, work: Path) -> Path:
    """The user's own clone (the catalog, and the lock render keeps), alice's."""
    checkout = work / "source"
    shutil.copytree(source, checkout, ignore=shutil.ignore_patterns("dist"))
    subprocess.run(["chown", "-R", f"{ALICE}:", str(checkout)], check=True)
    return checkout


def _site_node(work: Path) -> Path:
    """The site's node image (its own files), with the real Pyxis and Enroot it loads."""
    node = work / "node"
    node_image(node, SITE_FILES, PLUGIN)
    shutil.copyfile(f"/{PLUGIN}", node / PLUGIN)  # the real Pyxis the node loads
    local_bin = node / "usr/local/bin"  # the node's Enroot, where Pyxis's cleanup finds it
    local_bin.mkdir(parents=True, exist_ok=True)
    for program in Path("/usr/local/bin").glob("enroot*"):
        shutil.copy2(program, local_bin / program.name)
    return node


def _node_opt(work: Path, venv: Path) -> Path:
    opt = work / "node-opt"  # the node's /opt: imgpipe where the guide installs it
    opt.mkdir()
    (opt / "imgpipe").symlink_to(venv)
    return opt


@pytest.fixture
def site_cluster(registry_server) -> Iterator:
    """A 2-node Pyxis sandbox set up as the site: started by the test once its node image
    exists (its plugstack is the image's)."""
    from imgpipe.recipes.sandbox import SandboxSpec, running

    started: list = []

    def start(node: Path, opt: Path, **spec_values):
        spec = SandboxSpec(shared_folder("imgpipe-site-cluster-"), name="imgpf",
                           subnet="10.213.22", cpus=16, gpus=16,
                           plugstack=node / "etc/slurm/plugstack.conf", pyxis=True,
                           node_binds=f"{node}/usr/local/bin:/usr/local/bin,{opt}:/opt",
                           **spec_values)
        context = running(spec, registry_storage=registry_server.root / "data")
        sandbox = context.__enter__()
        started.append(context)
        return sandbox

    yield start
    for context in started:
        context.__exit__(None, None, None)


def _enroot_layers(cluster) -> str:
    """What Enroot's own import left in each node's per-user cache (node-local)."""
    done = cluster.run(["srun", "-N2", "--ntasks-per-node=1", "/bin/sh", "-c",
                        'echo "$(hostname) $(ls /var/tmp/enroot/cache/user-$(id -u) '
                        '2>/dev/null | wc -l)"'], user=ALICE, timeout=120, cwd="/tmp")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_first_hour_runs_as_written_and_leaves_the_sites_files(site_cluster, bert_cpu,
                                                                   site_etc, node_install
                                                                   ) -> None:
    work = shared_folder("imgpipe-first-hour-")
    node = _site_node(work)
    before = sums(node)
    source, venv = node_install
    cluster = site_cluster(node, _node_opt(work, venv))
    checkout = _clone(source, work)
    data = work / "lustre-bert"
    owned_by(ALICE, data, data / "results")
    env = {"REGISTRY": "head:5000", "REGISTRY_CA": "", "SQUASHFS": str(work / "squashfs"),
           "DISTRIBUTION": "shared", "STEPS": "1 2 3 4",
           "PARTITION": "debug", "DATA": str(data), "PROFILE_FROM": "local",
           "NODE_SHAPE": f"--cores-per-node {os.cpu_count()}", "FLAVOR": "cpu",
           "IMAGES": "", "RUNTIME": "pyxis", "NODES": "2", "TASKS": "2",
           "ACCEPT": "importer", "NODE_ROOT": str(node), "IMGPIPE": str(venv / "bin/imgpipe"),
           "AS_USER": ALICE, "CHECKOUT": str(checkout),
           "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    done = cluster.run(["bash", str(checkout / "docs" / "first-hour.sh")], env=env,
                       timeout=900, cwd="/tmp")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]

    # 1. the site config in /etc, read by every command, each key's file said
    site = (SITE_CONFIG / "imgpipe.yaml").read_text()
    assert "host: head" in site and "partition: debug" in site
    assert "/etc/imgpipe/imgpipe.yaml  registry.host=\"head\"" in said
    assert "/etc/imgpipe/imgpipe.yaml  recipes.partition=\"debug\"" in said
    # 3. the node: a diff first, then imgpipe's own files, the accepted line, nothing else
    assert f"  + {PYXIS} importer=/usr/local/bin/imgpipe-pyxis-importer" in said
    assert "  ! changes existing jobs: every job's --container-image" in said
    assert "plugstack: /etc/slurm/plugstack.conf (beside /etc/slurm/slurm.conf" in said
    after = sums(node)
    changed = {name for name in before if after.get(name) != before[name]}
    assert changed == {"etc/slurm/plugstack.conf"}, changed  # its own line, nothing beside
    assert not (node / "etc/slurm/plugstack.conf.d").exists()
    [backup] = (node / "var/lib/imgpipe/backups").rglob("plugstack.conf")
    assert backup.read_text() == SITE_FILES["etc/slurm/plugstack.conf"]
    assert os.readlink(node / "usr/local/bin/imgpipe-pyxis-importer") == \
        "/opt/imgpipe/bin/imgpipe-pyxis-importer"
    assert (node / "etc/imgpipe/imgpipe.yaml").read_text() == site
    assert (work / "squashfs" / ".imgpipe" / "VERSION").is_file()
    assert "profile site: matches this node" in said
    # 4. the first jobs: the NCCL check passed, judged by the site's profile, its tasks
    # started by real Pyxis through the accepted importer from the shared folder
    assert "PASS: all_reduce on 4 rank(s) / 2 node(s)" in said, said[-4000:]
    assert "judged against profile site" in said
    assert (data / "results" / "report" / "index.html").is_file()
    [log] = data.rglob("nccl-check-*.out")
    assert "pyxis: imported docker image: head:5000#imgpipe/bert@sha256:" in log.read_text()
    assert list((work / "squashfs").glob("imgpipe+bert+sha256-*.sqsh"))  # the importer's
    layers = _enroot_layers(cluster)
    assert set(layers.split()[1::2]) == {"0"}, layers  # Enroot imported nothing itself

    # the admin takes the line back: the site's own Pyxis line, Enroot's own import
    rolled = cluster.run([str(venv / "bin/imgpipe"), "node-config", "--rollback", "--root",
                          str(node)], timeout=120, cwd="/tmp")
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert (node / "etc/slurm/plugstack.conf").read_text() == \
        SITE_FILES["etc/slurm/plugstack.conf"]
    recipes = data / "first-hour-recipes"
    again = cluster.run(["sbatch", "--parsable", "--wait", "-N2", "--ntasks-per-node=2",
                         "--chdir", str(recipes), str(recipes / "nccl.sub")], user=ALICE,
                        timeout=900, cwd="/tmp")
    job = again.stdout.strip().splitlines()[0] if again.stdout.strip() else "?"
    outputs = [p.read_text() for p in data.rglob(f"nccl-check-{job}.out")]
    assert again.returncode == 0, (again.stderr, outputs)
    assert outputs and "pyxis: imported docker image: head:5000#imgpipe/bert@sha256:" in \
        outputs[0], outputs
    layers = _enroot_layers(cluster)
    assert all(int(count) > 0 for count in layers.split()[1::2]), layers  # Enroot imported


PASSWORD = "first-hour-Pa55word"


def _tls_and_logins(work: Path) -> tuple[str, Path, Path]:
    """The head registry's TLS (a certificate for the name "head", signed by the site's CA)
    and its logins (alice alone has an account): (CERT:KEY, the CA, the htpasswd file)."""
    import trustme

    from tests import services

    ca = trustme.CA()
    cert = ca.issue_cert("head")
    cert.cert_chain_pems[0].write_to_path(str(work / "head.crt"))
    cert.private_key_pem.write_to_path(str(work / "head.key"))
    site_ca = work / "site-ca.crt"
    ca.cert_pem.write_to_path(str(site_ca))
    site_ca.chmod(0o644)
    services.htpasswd_file(work / "htpasswd", ALICE, PASSWORD)
    return f"{work / 'head.crt'}:{work / 'head.key'}", site_ca, work / "htpasswd"


@pytest.fixture
def alices_login() -> Iterator[Path]:
    """Alice's own ~/.netrc (0600, hers) for the head registry, as she writes it; taken away
    after."""
    import pwd

    home = Path(pwd.getpwnam(ALICE).pw_dir)
    netrc = home / ".netrc"
    assert not netrc.exists()
    netrc.write_text(f"machine head login {ALICE} password {PASSWORD}\n")
    netrc.chmod(0o600)
    shutil.chown(netrc, ALICE, ALICE)
    yield netrc
    netrc.unlink(missing_ok=True)


def test_the_first_hour_on_a_node_local_rack_with_a_registry_that_asks_for_logins(
        site_cluster, bert_cpu, site_etc, node_install, alices_login) -> None:
    """The same script on a rack whose nodes keep images on their own disks (a tmpfs each,
    empty at every start), from a head registry with TLS and logins: site init writes the
    CA and `credentials: netrc`; step 3 installs the unit that makes the node-local folder at
    boot (here: its ExecStart run on each node as root, as the boot would); alice's job reads
    the registry with her own login, once, and every node runs the NCCL check from its own
    copy; bob, who has no login, ends in one line that says so."""
    work = shared_folder("imgpipe-first-hour-local-")
    node = _site_node(work)
    tls, site_ca, htpasswd = _tls_and_logins(work)
    (node / site_ca.relative_to("/")).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(site_ca, node / site_ca.relative_to("/"))  # the CA, where the node image has it
    disks = work / "nvme"  # each node's own disk; the login node sees a plain folder
    source, venv = node_install
    cluster = site_cluster(node, _node_opt(work, venv), compute_nodes=4, node_disks=str(disks),
                           registry_tls=tls, registry_htpasswd=str(htpasswd))
    checkout = _clone(source, work)
    data = work / "lustre-bert"
    owned_by(ALICE, data, data / "results")
    squashfs = disks / "imgpipe" / "squashfs"
    env = {"REGISTRY": "head:5000", "REGISTRY_CA": str(site_ca), "CREDENTIALS": "netrc",
           "SQUASHFS": str(squashfs), "DISTRIBUTION": "broadcast", "PARTITION": "debug",
           "DATA": str(data), "PROFILE_FROM": "local",
           "NODE_SHAPE": f"--cores-per-node {os.cpu_count()}", "FLAVOR": "cpu",
           "IMAGES": "", "RUNTIME": "pyxis", "NODES": "4", "TASKS": "1",
           "ACCEPT": "importer", "NODE_ROOT": str(node), "IMGPIPE": str(venv / "bin/imgpipe"),
           "AS_USER": ALICE, "CHECKOUT": str(checkout),
           "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    script = str(checkout / "docs" / "first-hour.sh")
    done = cluster.run(["bash", script], env={**env, "STEPS": "1 2 3"}, timeout=600, cwd="/tmp")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    site = yaml.safe_load((SITE_CONFIG / "imgpipe.yaml").read_text())
    assert site["registry"]["scheme"] == "https" and site["registry"]["ca_file"] == str(site_ca)
    assert site["registry"]["credentials"] == {"source": "netrc"}
    assert site["enroot"]["distribution"] == "broadcast"
    assert "registry.ca_file" not in said or "which this node lacks" not in said
    unit = (node / "etc/systemd/system/imgpipe-cache.service").read_text()
    start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert start == f"ExecStart=/opt/imgpipe/bin/imgpipe node-config --make-cache {squashfs}"
    assert os.readlink(node / "etc/systemd/system/multi-user.target.wants/"
                       "imgpipe-cache.service") == "/etc/systemd/system/imgpipe-cache.service"

    # the boot: each node's disk is empty until the unit makes the folder
    booted = cluster.run(["srun", "-N4", "--ntasks-per-node=1", "-p", "debug",
                          *start.removeprefix("ExecStart=").split()], timeout=180, cwd="/tmp")
    assert booted.returncode == 0, booted.stdout + booted.stderr
    done = cluster.run(["bash", script], env={**env, "STEPS": "4"}, timeout=900, cwd="/tmp")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    assert "needs a registry login" not in said
    assert "PASS: all_reduce on 4 rank(s) / 4 node(s)" in said, said[-4000:]
    [log] = data.rglob("nccl-check-*.out")
    assert "pyxis: imported docker image: head:5000#imgpipe/bert@sha256:" in log.read_text()
    copies = cluster.run(["srun", "-N4", "--ntasks-per-node=1", "/bin/sh", "-c",
                          f'echo "$(hostname) $(find {squashfs} -name "*.sqsh" | wc -l)"'],
                         user=ALICE, timeout=120, cwd="/tmp")
    assert copies.returncode == 0, copies.stderr
    counts = dict(line.split() for line in copies.stdout.splitlines())
    assert sorted(counts) == ["node1", "node2", "node3", "node4"], copies.stdout
    assert all(int(count) >= 1 for count in counts.values()), counts  # each node its own
    assert not list(squashfs.glob("**/*.sqsh"))  # the login node's folder: nothing

    # bob has no login: his job ends in one line that says so, none of alice's copies his
    recipes, bob = data / "first-hour-recipes", work / "bob"
    owned_by(USERS[1], bob)
    (data / "results").chmod(0o1777)  # the project's results folder, shared with bob
    bobs = cluster.run(["sbatch", "--parsable", "--wait", "-N4", "--ntasks-per-node=1",
                        "--output", f"{bob}/nccl-%j.out", "--chdir", str(bob),
                        str(recipes / "nccl.sub")], user=USERS[1], timeout=600, cwd="/tmp")
    [bob_log] = bob.glob("nccl-*.out")
    told = bob_log.read_text()
    assert bobs.returncode != 0, told[-3000:]
    assert "login" in told, told[-3000:]
