"""The layers of DESIGN.md hold in the imports (import-linter), and the check has teeth:
the same checker fails on a contract the code breaks, naming the import that breaks it."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("imgpipe.cli", "imgpipe.commands", "imgpipe.pipeline", "imgpipe.registry",
         "imgpipe.enroot", "imgpipe.recipes", "imgpipe.base")
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint(config: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [*LINT, "--no-cache"] + (["--config", str(config)] if config else [])
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]


def test_the_layers_and_the_process_chokepoint_hold() -> None:
    done = lint()
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"{len(contracts())} kept, 0 broken" in done.stdout
    assert "cli parses, calls commands, renders: it reaches no subsystem itself KEPT" in \
        done.stdout
    assert "enroot/ in import order, as enroot/__init__.py maps it" in done.stdout
    assert "commands/ by who calls it and where it runs, as commands/__init__.py maps it" \
        in done.stdout


def _map(package: Path) -> list[str]:
    """The names a package's ``__init__`` docstring maps: the first word of each line indented
    by four, in order (a folder is written with its slash)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False)
    return [line.split()[0].rstrip("/") for line in (doc or "").splitlines()
            if line.startswith("    ") and not line.startswith("     ")]


def _modules(package: Path) -> set[str]:
    return {path.stem for path in package.glob("*.py") if path.stem != "__init__"} \
        | {path.parent.name for path in package.glob("*/__init__.py")}


@pytest.mark.parametrize("folder", ["enroot", "enroot/published", "enroot/fetch",
                                    "enroot/flatten", "enroot/squash", "enroot/cache",
                                    "commands", "commands/demo", "commands/builds",
                                    "commands/registry", "commands/site", "commands/node",
                                    "commands/shared"])
def test_each_map_names_every_module_in_its_contracts_order(folder: str) -> None:
    """enroot/'s and commands/' maps (their __init__ docstrings) and their layers contracts
    list the same modules in the same order, and every module of the folder is on both:
    neither can go stale."""
    package = ROOT / folder
    name = "imgpipe." + folder.replace("/", ".")
    [contract] = [c for c in contracts() if c.get("containers") == [name]]
    assert contract["type"] == "layers" and contract.get("exhaustive") is True
    layered = [module.strip() for layer in contract["layers"] for module in layer.split("|")]
    assert _map(package) == layered, f"{folder}/__init__.py's map and pyproject.toml's order"
    assert set(layered) == _modules(package), f"{folder}: a module off the map"
    for sub in package.glob("*/__init__.py"):  # a folder's __init__ maps; it imports nothing
        tree = ast.parse(sub.read_text())
        assert [type(node).__name__ for node in tree.body] == ["Expr"], sub


def test_no_module_passes_500_lines() -> None:
    """One job per module (STYLE.md: 150-500 lines): a module past 500 lines holds two and
    is split where they part, named here."""
    long = [f"{path.relative_to(ROOT)}: {lines} lines" for root in ROOTS
            for path in sorted((ROOT / root.removeprefix("imgpipe.")).rglob("*.py"))
            if (lines := len(path.read_text().splitlines())) > 500]
    assert long == []


def test_a_module_off_the_map_and_an_import_across_fail_the_check(tmp_path: Path) -> None:
    """The enroot/ contract with nodeconfig left off its map, and the flattener forbidden the
    layer errors it really imports: both are named."""
    [real] = [c for c in contracts() if c.get("containers") == ["imgpipe.enroot"]]
    layers = ", ".join(f'"{layer}"' for layer in real["layers"]).replace(" | nodeconfig", "")
    config = tmp_path / "wrong.toml"
    config.write_text(f'''
[tool.importlinter]
root_packages = ["imgpipe.enroot", "imgpipe.registry", "imgpipe.base"]
include_external_packages = true

[[tool.importlinter.contracts]]
name = "nodeconfig off the map (wrong on purpose)"
type = "layers"
containers = ["imgpipe.enroot"]
exhaustive = true
layers = [{layers}]

[[tool.importlinter.contracts]]
name = "the flattener without the errors (wrong on purpose)"
type = "forbidden"
source_modules = ["imgpipe.enroot.flatten"]
forbidden_modules = ["imgpipe.enroot.errors"]
''')
    done = lint(config)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "0 kept, 2 broken" in done.stdout
    assert "- imgpipe.enroot.nodeconfig" in done.stdout
    assert "imgpipe.enroot.flatten.rules -> imgpipe.enroot.errors" in done.stdout


def test_a_back_edge_fails_the_check_and_is_named(tmp_path: Path) -> None:
    """A contract with the base above the registry: the registry's real imports of the base
    are then back-edges, and a forbidden subprocess without the chokepoint's exemption."""
    config = tmp_path / "wrong.toml"
    config.write_text('''
[tool.importlinter]
root_packages = ["imgpipe.registry", "imgpipe.base", "imgpipe.enroot"]
include_external_packages = true

[[tool.importlinter.contracts]]
name = "base above registry (wrong on purpose)"
type = "layers"
layers = ["imgpipe.base", "imgpipe.registry"]

[[tool.importlinter.contracts]]
name = "nobody starts programs (wrong on purpose)"
type = "forbidden"
source_modules = ["imgpipe.base", "imgpipe.enroot"]
forbidden_modules = ["subprocess"]
allow_indirect_imports = true
''')
    done = lint(config)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "0 kept, 2 broken" in done.stdout
    assert "imgpipe.registry.client -> imgpipe.base.files" in done.stdout
    assert "imgpipe.base.process -> subprocess" in done.stdout


def test_no_module_imports_itself_through_others() -> None:
    """No cycle at module level either (the layers contract sees packages): a module-level
    strongly connected component of more than one module fails, named."""
    import grimp

    graph = grimp.build_graph(*ROOTS)
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m)
                 if i in graph.modules and i != m} for m in graph.modules}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for other in edges[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in order:
            visit(module)
    assert cycles == []
    assert len(graph.modules) > 60
