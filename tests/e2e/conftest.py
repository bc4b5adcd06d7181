"""Session fixtures that start real parts: the Docker engine, registries, the base image,
the multi-host sandbox cluster and the bert cpu image as a squashfs file.

A missing part fails the tests that need it; nothing is skipped silently.  Every test in
this folder is marked ``e2e``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from imgpipe.cli.main import main
from tests import services
from tests.conftest import CliRun
from tests.tenants import shared_writer, site  # noqa: F401 (fixtures of test_tenants*.py)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[None]:
    with services.docker_engine():
        yield
        # The images tagged for this run's registries go with them (see untag_images_of).
        services.untag_images_of(services.PORTS_HANDED_OUT)


@pytest.fixture(scope="session")
def base_image(docker_engine: None) -> str:
    return services.ensure_base_image()


@pytest.fixture(scope="session")
def registry_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.RegistryProcess]:
    """One plain-HTTP registry for the session (docker treats 127.0.0.1 as insecure-ok)."""
    server = services.start_registry(tmp_path_factory.mktemp("registry"))
    yield server
    server.stop()


@pytest.fixture
def managed_registry(cli: CliRun) -> Iterator[CliRun]:
    """A registry started by `imgpipe registry up` (binary mode) on a free port."""
    cli.write_config({"registry": {"port": services.free_port(),
                                   "server": {"mode": "binary"}}})
    code, out, err = cli("registry", "up")
    assert code == 0, err
    yield cli
    cli("registry", "down")


@pytest.fixture(scope="session")
def cluster(registry_server: services.RegistryProcess) -> Iterator:
    """A head host (slurmctld, and a registry serving the test registry's content read-only)
    and two compute hosts, each a network namespace with its own hostname and address."""
    from imgpipe.recipes.sandbox import SandboxSpec, running
    from tests.cluster import ensure_users, prepare_node_devices, shared_folder

    ensure_users()
    prepare_node_devices()
    spec = SandboxSpec(shared_folder("imgpipe-cluster-"), name="imgpt", subnet="10.213.9",
                       cpus=16, gpus=16)
    with running(spec, registry_storage=registry_server.root / "data") as sandbox:
        yield sandbox


@pytest.fixture(scope="session")
def bert_cpu(tmp_path_factory: pytest.TempPathFactory, registry_server: services.RegistryProcess,
             base_image: str) -> dict:
    """The repository's bert image, cpu flavor, built, pushed and converted to squashfs in a
    folder every user can read: {"reference", "squashfs", "project"}."""
    import json
    import shutil

    from tests.cluster import shared_folder

    project = tmp_path_factory.mktemp("bert-project")
    repository = Path(__file__).resolve().parents[2]
    shutil.copytree(repository / "images" / "bert", project / "images" / "bert")
    squashfs = shared_folder("imgpipe-squashfs-")
    (project / "imgpipe.yaml").write_text(yaml.safe_dump({
        "registry": {"port": registry_server.port},
        "build": {"wheels_dir": str(services.torch_wheels_dir())},
        "outputs": {"squashfs_dir": str(squashfs)},
        "default_flavor": "cpu"}))
    old = Path.cwd()
    os.chdir(project)
    try:
        for argv in (["build", "bert"], ["push", "bert", "--convert"]):
            assert main(argv) == 0, argv
    finally:
        os.chdir(old)
    entry = json.loads((project / "imgpipe.lock").read_text())["images"]["bert"]["cpu"]
    assert entry["squashfs"], entry
    return {"squashfs": Path(entry["squashfs"]), "project": project,
            "reference": f"{entry['repository']}@{entry['digest']}"}
