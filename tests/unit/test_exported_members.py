"""The public surface of each subsystem is explicit: changing it is a deliberate act.  What
the wheel ships (built by pip): tests/e2e/test_wheel_contents.py."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

# Every folder of code, each imgpipe.<folder> (pyproject.toml maps them).
FOLDERS = ("cli", "commands", "pipeline", "registry", "enroot", "recipes", "base")
ROOT = Path(__file__).resolve().parents[2]


def source_modules() -> list[tuple[Path, str]]:
    """Every module of the tree, sub-packages included: (its file, its import name)."""
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found.append((path, ".".join(("imgpipe", folder, *parts)).removesuffix(".__init__")))
    return found

EXPECTED = {
    "imgpipe.base": ["CommandError", "ConfigError", "ImgpipeError", "Settings",
                         "ToolMissingError", "atomic_path", "atomic_write", "load_settings"],
    "imgpipe.registry": ["AuthError", "Credentials", "DigestMismatchError", "LocalRegistry",
                         "LocalRegistryError", "Manifest", "Platform", "Reference",
                         "ReferenceFormatError", "RegistryClient", "RegistryError", "Removal",
                         "ServerState", "TagInfo", "remove_tag", "tag_digests"],
}


@pytest.mark.parametrize("module_name", sorted(EXPECTED))
def test_exported_members(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == sorted(EXPECTED[module_name])
    for name in module.__all__:
        assert getattr(module, name) is not None


def test_every_user_error_derives_from_the_one_base() -> None:
    from imgpipe.base.errors import ImgpipeError
    from imgpipe.registry import errors

    for name in ("RegistryError", "AuthError", "DigestMismatchError", "ReferenceFormatError",
                 "LocalRegistryError"):
        assert issubclass(getattr(errors, name), ImgpipeError)


def test_subsystem_names_do_not_leak_as_top_level_imports() -> None:
    import sys

    for leaked in FOLDERS:
        spec_paths = [p for p in sys.path if p and p.endswith(("site-packages",))]
        for path in spec_paths:
            assert not (__import__("pathlib").Path(path) / leaked).exists(), (path, leaked)


def test_the_error_tree_drawn_in_the_docstring_is_the_real_one() -> None:
    """Every ImgpipeError subclass appears in base/errors.py's drawing, under its
    real parent: the one place a reader learns the tree must not drift from the code."""
    import importlib
    import re

    for _, module in source_modules():  # every module: an error class may live anywhere
        importlib.import_module(module)
    from imgpipe.base import errors
    from imgpipe.base.errors import ImgpipeError

    drawn: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in (errors.__doc__ or "").splitlines():
        match = re.match(r"^(\s*(?:[│ ]   )*)(?:[├└]── )?(\w+Error)\b", line)
        if not match:
            continue
        depth = len(match.group(1)) // 4 + (1 if "──" in line else 0)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        drawn[match.group(2)] = stack[-1][1] if stack else ""
        stack.append((depth, match.group(2)))

    def subclasses(cls: type) -> list[type]:
        found = []
        for sub in cls.__subclasses__():
            found += [sub, *subclasses(sub)]
        return found

    real = {cls.__name__: cls.__bases__[0].__name__ for cls in subclasses(ImgpipeError)
            if cls.__module__.startswith("imgpipe.")}
    assert {name: drawn.get(name) for name in real} == real


def test_every_module_imports_on_its_own() -> None:
    """Each module imports with no other imgpipe module imported first (no module depends on
    another having been loaded before it): every imgpipe module is dropped from sys.modules
    before each import.  Third-party modules stay loaded; they cannot hide an order
    dependency between imgpipe's own."""
    import importlib
    import sys

    modules = [module for path, module in source_modules() if path.stem != "__init__"]
    assert len(modules) > 40
    saved = {name: module for name, module in sys.modules.items()
             if name.startswith("imgpipe.")}
    failures = {}
    try:
        for module in modules:
            for name in [n for n in sys.modules if n.startswith("imgpipe.")]:
                del sys.modules[name]
            try:
                importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 (any failure is the finding)
                failures[module] = f"{type(exc).__name__}: {exc}"
    finally:
        for name in [n for n in sys.modules if n.startswith("imgpipe.")]:
            del sys.modules[name]
        sys.modules.update(saved)
    assert failures == {}
