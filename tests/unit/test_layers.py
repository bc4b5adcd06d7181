"""The layers of DESIGN.md hold in the imports (import-linter), and the check has teeth:
the same checker fails on a contract the code breaks, naming the import that breaks it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint(config: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [*LINT, "--no-cache"] + (["--config", str(config)] if config else [])
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_layers_and_the_process_chokepoint_hold() -> None:
    done = lint()
    assert done.returncode == 0, done.stdout[-3000:]
    assert "3 kept, 0 broken" in done.stdout


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
