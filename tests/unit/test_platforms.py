"""Platforms as users write them and as nodes take them: one spelling, the catalog's
platforms, change detection per platform, who builds which platform, the lock's platform
pins, the job scripts' choice of image by the node's platform, the sandbox's arm64 hosts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from imgpipe.base import builders
from imgpipe.base.errors import ConfigError, ImgpipeError
from imgpipe.base.files import SquashfsPath
from imgpipe.base.platforms import Platform, host_platform, node_platform, parse_platforms
from imgpipe.pipeline.catalog import load_image
from imgpipe.pipeline.lock import LockEntry, NotPushedError, PlatformPin
from imgpipe.pipeline.plan import plan_image
from imgpipe.recipes.profiles import load_profile
from imgpipe.recipes.render import RecipeInputs, render_bundle
from imgpipe.recipes.sandboxfiles import write_platform_prolog

AMD, ARM = Platform.parse("linux/amd64"), Platform.parse("linux/arm64")
DIGEST = {p: f"sha256:{c * 64}" for p, c in (("linux/amd64", "a"), ("linux/arm64", "b"))}


def test_one_spelling_of_a_platform() -> None:
    assert Platform.parse("linux/arm64/v8") == ARM and str(ARM) == "linux/arm64"
    assert ARM.machine == "aarch64" and AMD.machine == "x86_64"
    assert ARM.oci() == {"os": "linux", "architecture": "arm64"}
    assert Platform.parse("linux/arm/v7").tag_suffix == "arm-v7"
    assert parse_platforms("linux/amd64, linux/arm64,linux/amd64") == (AMD, ARM)
    for bad in ("arm64", "linux/", "Linux/ARM64", "linux/arm64/v8/x"):
        with pytest.raises(ConfigError, match="is not a platform"):
            Platform.parse(bad)


def test_a_node_takes_its_own_platform_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IMGPIPE_PLATFORM", raising=False)
    assert node_platform() == host_platform()
    monkeypatch.setenv("IMGPIPE_PLATFORM", "linux/arm64")
    assert node_platform() == ARM


def _image(folder: Path, platforms: object) -> Path:
    folder.mkdir(parents=True)
    (folder / "Dockerfile").write_text("ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\n")
    (folder / "image.yaml").write_text(
        "name: bert\nrepository: imgpipe/bert\nversion: 1.0.0\n"
        f"platforms: {platforms}\n"
        "flavors:\n  cpu:\n    base: local/base:amd64\n"
        "    platform_bases: {linux/arm64/v8: local/base:arm64}\n")
    return folder


def test_image_yaml_names_platforms_and_their_bases(tmp_path: Path) -> None:
    image = load_image(_image(tmp_path / "bert", "[linux/arm64, linux/amd64, linux/arm64]"))
    assert image.platforms == (ARM, AMD)
    assert image.flavor("cpu").base_for(ARM) == "local/base:arm64"
    assert image.flavor("cpu").base_for(AMD) == "local/base:amd64"
    with pytest.raises(ConfigError, match=r"bert/image.yaml: platforms: 'aarch64' is not a "
                       r"platform"):
        load_image(_image(tmp_path / "bad" / "bert", "[aarch64]"))


def test_platforms_are_an_input_and_a_one_platform_build_hashes_as_before(tmp_path: Path
                                                                          ) -> None:
    from imgpipe.pipeline.lock import LockFile

    image = load_image(_image(tmp_path / "bert", "[]"))
    bases = {"local/base:amd64": "sha256:" + "1" * 64, "local/base:arm64": "sha256:" + "2" * 64}

    def plan(platforms: tuple[Platform, ...] = ()):  # type: ignore[no-untyped-def]
        return plan_image(image, "cpu", LockFile(), overrides={}, base_override=None,
                          wheels_dir=None, resolve_base=bases.get, platforms=platforms)

    one = plan()
    assert "platforms" not in one.inputs  # the hash a lock from before platforms recorded
    both, amd = plan((AMD, ARM)), plan((AMD,))
    assert len({one.input_hash, both.input_hash, amd.input_hash}) == 3
    assert both.base_for(ARM) == "local/base:arm64"
    bases["local/base:arm64"] = "sha256:" + "3" * 64  # the arm64 base moved on
    assert plan((AMD, ARM)).input_hash != both.input_hash
    assert plan((AMD,)).input_hash == amd.input_hash


def test_who_builds_which_platform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builders, "BINFMT_DIR", tmp_path)
    assert builders.build_route(host_platform(), {}) == "native"
    other = ARM if host_platform() != ARM else AMD
    with pytest.raises(ImgpipeError, match=f"cannot build {other}: no emulator"):
        builders.build_route(other, {})
    entry = tmp_path / f"qemu-{other.machine}"
    entry.write_text("enabled\ninterpreter /usr/libexec/qemu-binfmt/x\nflags: P\n")
    with pytest.raises(ImgpipeError):  # without fix-binary it fails inside containers
        builders.build_route(other, {})
    entry.write_text("enabled\ninterpreter /usr/libexec/qemu-binfmt/x\nflags: PF\n")
    assert builders.build_route(other, {}) == f"emulated: binfmt qemu-{other.machine}"
    assert builders.build_route(other, {str(other): "ssh://grace"}) == "native builder ssh://grace"


def test_the_lock_keeps_each_platforms_manifest() -> None:
    pins = {p: PlatformPin(digest=d, config_digest=d) for p, d in DIGEST.items()}
    entry = LockEntry(repository="head:5000/imgpipe/bert", tags=["1"], digest="sha256:" + "9" * 64,
                      config_digest=DIGEST["linux/amd64"], input_hash="h", inputs={},
                      flavor="cpu", base="b", pushed_at="now", platforms=pins)
    assert entry.platform_pin(ARM).digest == DIGEST["linux/arm64"]
    assert entry.holder(DIGEST["linux/arm64"]) is entry.platforms["linux/arm64"]
    assert entry.holder(entry.digest) is None  # the index has no squashfs of its own
    with pytest.raises(NotPushedError, match=r"has no linux/s390x image \(it has linux/amd64, "
                       r"linux/arm64\)"):
        entry.platform_pin(Platform.parse("linux/s390x"))


def _squashfs(path: Path) -> SquashfsPath:
    path.write_bytes(b"hsqs" + b"\0" * 92)
    checked = SquashfsPath.checked(str(path))
    assert checked is not None
    return checked


def _chosen(run_sub: str, platform: str | None) -> subprocess.CompletedProcess[str]:
    start = run_sub.index("# One image per platform")
    block = run_sub[start:run_sub.index("esac\n", start) + 5]
    env = {"PATH": "/usr/bin:/bin", **({"IMGPIPE_PLATFORM": platform} if platform else {})}
    return subprocess.run(["bash", "-c", block + 'echo "$default_cont"'], env=env,
                          capture_output=True, text=True)


def test_one_run_sub_picks_the_image_of_the_nodes_platform(tmp_path: Path) -> None:
    files = {p: _squashfs(tmp_path / f"{p.replace('/', '-')}.sqsh") for p in DIGEST}
    render_bundle(RecipeInputs(load_profile("local"), 1, files["linux/amd64"],
                               runtime="charliecloud", platform_images=dict(files),
                               selftest=("uname", "-m")), tmp_path / "bundle")
    run_sub = (tmp_path / "bundle" / "run.sub").read_text()
    assert _chosen(run_sub, "linux/arm64").stdout.strip() == str(files["linux/arm64"])
    assert _chosen(run_sub, "linux/amd64").stdout.strip() == str(files["linux/amd64"])
    mine = _chosen(run_sub, None).stdout.strip()  # uname -m of this machine
    assert mine == str(files.get(str(host_platform()), "")) or host_platform() not in (AMD, ARM)
    odd = _chosen(run_sub, "linux/s390x")
    assert odd.returncode == 2
    assert "run.sub: no image for platform linux/s390x (this bundle has linux/amd64 " \
        "linux/arm64)" in odd.stderr
    assert "launch uname -m" in run_sub
    for config in (tmp_path / "bundle").glob("config_*.sh"):  # a CONT there would win
        assert "export CONT=" not in config.read_text()
    dataset = (tmp_path / "bundle" / "dataset.sub").read_text()
    assert _chosen(dataset, "linux/arm64").stdout.strip() == str(files["linux/arm64"])
    subprocess.run(["shellcheck", "-S", "warning", str(tmp_path / "bundle" / "run.sub")],
                   check=True)


def test_an_emulated_sandbox_host_tells_its_tasks_their_platform(tmp_path: Path) -> None:
    prolog = write_platform_prolog(tmp_path, {"node2": ARM})
    assert prolog is not None

    def told(node: str) -> str:
        return subprocess.run([str(prolog)], env={"SLURMD_NODENAME": node, "PATH": "/bin"},
                              capture_output=True, text=True, check=True).stdout

    # and the CPU qemu emulates for them (not qemu's default: its SVE is 10x slower)
    assert told("node2") == "export IMGPIPE_PLATFORM=linux/arm64\nexport QEMU_CPU=neoverse-n1\n"
    assert told("node1") == ""
    assert write_platform_prolog(tmp_path, {}) is None and not prolog.exists()


def test_an_emulated_arm64_host_shows_an_arm_proc_cpuinfo(tmp_path: Path) -> None:
    """qemu-user 7.2 shows aarch64 programs this host's x86 /proc/cpuinfo, and `import torch`
    dies on it (PyTorch's cpuinfo finds no Arm core): emulated containers and sandbox hosts
    get an Arm one, as many entries as this host has CPUs, the emulated core's part."""
    from imgpipe.base.platforms import emulated_cpuinfo, emulation_env
    from imgpipe.recipes.sandboxfiles import SandboxSpec, write_boot_script, write_config

    other = ARM if host_platform() != ARM else Platform.parse("linux/amd64")
    text = emulated_cpuinfo(ARM, cpus=3)
    if other == ARM:
        assert text is not None
        assert text.count("processor\t:") == 3 and "CPU implementer\t: 0x41" in text
        assert "CPU part\t: 0xd0c" in text and "Features\t: fp asimd" in text
        assert emulation_env(ARM) == {"QEMU_CPU": "neoverse-n1"}
    assert emulated_cpuinfo(host_platform()) is None and emulation_env(host_platform()) == {}

    spec = SandboxSpec(tmp_path, platforms=f"node2={other}")
    write_config(spec, tmp_path)
    write_boot_script(tmp_path)
    assert (tmp_path / "cpuinfo-node2").exists() == (other == ARM)
    assert not (tmp_path / "cpuinfo-node1").exists()
    boot = (tmp_path / "boot.sh").read_text()
    assert f'mount --bind "{tmp_path}/cpuinfo-$(hostname)" /proc/cpuinfo' in boot
    write_config(SandboxSpec(tmp_path), tmp_path)  # node2 back to this host's platform
    assert not (tmp_path / "cpuinfo-node2").exists()


def test_the_job_scripts_record_the_digest_of_the_image_they_picked(tmp_path: Path) -> None:
    files = {p: _squashfs(tmp_path / f"{p.replace('/', '-')}.sqsh") for p in DIGEST}
    render_bundle(RecipeInputs(load_profile("local"), 1, files["linux/amd64"],
                               runtime="charliecloud", platform_images=dict(files),
                               platform_digests=dict(DIGEST)), tmp_path / "bundle")
    run_sub = (tmp_path / "bundle" / "run.sub").read_text()
    start = run_sub.index("# One image per platform")
    block = run_sub[start:run_sub.index("esac\n", start) + 5]
    for platform, digest in DIGEST.items():
        shown = subprocess.run(["bash", "-c", block + 'echo "$default_image_digest"'],
                               env={"PATH": "/usr/bin:/bin", "IMGPIPE_PLATFORM": platform},
                               capture_output=True, text=True).stdout.strip()
        assert shown == digest
    assert 'export IMGPIPE_IMAGE="$CONT" IMGPIPE_IMAGE_DIGEST="$image_digest"' in run_sub


def test_a_conversion_pinned_by_its_path_still_names_its_digest(tmp_path: Path) -> None:
    from imgpipe.base.config import Settings
    from imgpipe.commands.builds.recipes import pinned_digest

    hexed = "ab" * 32
    converted = _squashfs(tmp_path / f"imgpipe+bert+sha256-{hexed}+zstd-f2.sqsh")
    assert pinned_digest(Settings(root=tmp_path), converted) == f"sha256:{hexed}"
    typed = _squashfs(tmp_path / "mine.sqsh")
    assert pinned_digest(Settings(root=tmp_path), typed) == ""
    assert pinned_digest(Settings(root=tmp_path), f"head:5000/x@sha256:{hexed}") == \
        f"sha256:{hexed}"
