"""The layers of DESIGN.md hold in the imports (import-linter), and the check has teeth:
the same checker fails on a contract the code breaks, naming the import that breaks it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("imgpipe.cli", "imgpipe.commands", "imgpipe.pipeline", "imgpipe.registry",
         "imgpipe.enroot", "imgpipe.recipes", "imgpipe.base")
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint(config: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [*LINT, "--no-cache"] + (["--config", str(config)] if config else [])
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_layers_and_the_process_chokepoint_hold() -> None:
    done = lint()
    assert done.returncode == 0, done.stdout[-3000:]
    assert "5 kept, 0 broken" in done.stdout
    assert "cli parses, calls commands, renders: it reaches no subsystem itself KEPT" in \
        done.stdout
    assert "the converter's layers, as enroot/__init__.py maps them KEPT" in done.stdout


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
