"""commands/ shows who calls it: no module sits at its top (only folders, one per side), and
the node side (what runs on compute nodes as the job's user, where the threat model looks
first) reaches nothing of the build side, the build subsystem or the demo, directly or
through any other module.  Each failure names the module (and the chain of imports).

import-linter keeps the same rules (pyproject.toml's ``commands`` and ``commands-node``
contracts); this reads the imports itself with ``ast``, in a fraction of a second, so the
message can say which file to move or which import to drop."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("cli", "commands", "pipeline", "registry", "enroot", "recipes", "base")
NODE_SIDE = "imgpipe.commands.node"
OFF_LIMITS = ("imgpipe.commands.builds", "imgpipe.commands.demo", "imgpipe.pipeline")


def stray_modules(root: Path) -> list[str]:
    """Modules at the top of commands/ (only ``__init__.py`` belongs there), and folders of
    modules with no ``__init__.py`` (a package the wheel would leave out)."""
    commands = root / "commands"
    stray = [f"commands/{path.name}" for path in sorted(commands.glob("*.py"))
             if path.name != "__init__.py"]
    stray += [f"commands/{folder.name}/ (no __init__.py)" for folder in sorted(commands.iterdir())
              if folder.is_dir() and any(folder.glob("*.py"))
              and not (folder / "__init__.py").exists()]
    return stray


def _name(root: Path, path: Path) -> str:
    return ".".join(("imgpipe", *path.relative_to(root).with_suffix("").parts)) \
        .removesuffix(".__init__")


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the tree and every imgpipe module it imports, anywhere in it (at the
    top, inside a function, under TYPE_CHECKING: import-linter counts them all)."""
    modules = {_name(root, path): path for folder in FOLDERS if (root / folder).is_dir()
               for path in sorted((root / folder).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in node.names)
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def _off_limits(module: str) -> bool:
    return any(module == banned or module.startswith(banned + ".") for banned in OFF_LIMITS)


def node_side_violations(root: Path, graph: dict[str, set[str]] | None = None) -> list[str]:
    """Every node-side module that reaches an off-limits one, with the shortest chain
    (``graph``: import_graph(root), when the caller read it already)."""
    graph = import_graph(root) if graph is None else graph
    found = []
    for start in sorted(m for m in graph if m == NODE_SIDE or m.startswith(NODE_SIDE + ".")):
        came_from: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:
            module = queue.popleft()
            if _off_limits(module):
                chain = [module]
                while (before := came_from[chain[-1]]) is not None:
                    chain.append(before)
                found.append(" -> ".join(reversed(chain)))
                break
            for target in sorted(graph.get(module, ())):
                if target not in came_from:
                    came_from[target] = module
                    queue.append(target)
    return found


def test_no_module_sits_at_the_top_of_commands() -> None:
    stray = stray_modules(ROOT)
    assert stray == [], ("commands/ holds only folders (commands/__init__.py maps them); move "
                         f"these into the folder of who calls them: {', '.join(stray)}")


def test_the_node_side_reaches_no_build_side_and_no_demo() -> None:
    graph = import_graph(ROOT)
    found = node_side_violations(ROOT, graph)
    assert found == [], "the node side imports the build side or the demo:\n" + "\n".join(found)
    assert len(graph) > 100  # the tree was read, not an empty folder


def test_the_checks_name_the_module(tmp_path: Path) -> None:
    """A stray module at the top, and a node-side module that reaches the build side through
    the shared wiring from inside a function: both named, the second with its chain."""
    files = {
        "commands/__init__.py": '"""map"""\n',
        "commands/helpers.py": "X = 1\n",
        "commands/node/__init__.py": '"""map"""\n',
        "commands/node/importer.py": ("def get() -> None:\n"
                                      "    from imgpipe.commands.shared.wiring import storage\n"),
        "commands/node/cache.py": "from . import importer\n",
        "commands/shared/__init__.py": '"""map"""\n',
        "commands/shared/wiring.py": "from imgpipe.commands.builds.images import build_all\n",
        "commands/builds/__init__.py": '"""map"""\n',
        "commands/builds/images.py": "",
        "commands/loose/recipes.py": "",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert stray_modules(tmp_path) == ["commands/helpers.py", "commands/loose/ (no __init__.py)"]
    assert node_side_violations(tmp_path) == [
        "imgpipe.commands.node.cache -> imgpipe.commands.node.importer -> "
        "imgpipe.commands.shared.wiring -> imgpipe.commands.builds.images",
        "imgpipe.commands.node.importer -> imgpipe.commands.shared.wiring -> "
        "imgpipe.commands.builds.images"]
