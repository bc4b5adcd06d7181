"""Package names resolved on first use (PEP 562), for packages whose ``__init__`` re-exports
its modules' public names: importing one light module of the package must not import them
all (the Pyxis importer's fast path and ``imgpipe --help`` stay clear of pydantic and
requests)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, home: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``home[name]`` when ``name`` is first used."""

    def __getattr__(name: str) -> Any:
        if name in home:
            return getattr(importlib.import_module(home[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
