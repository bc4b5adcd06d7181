"""Rendering command results: human text on a terminal, one JSON envelope with --json.

Results go to stdout, progress and errors to stderr.  The envelope is
versioned so scripts can rely on it::

    {"version": 1, "command": "registry tags", "status": "ok", "data": {...}, "errors": []}
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from imgpipe.base.terminal import safe_line

ENVELOPE_VERSION = 1


@dataclass
class Invocation:
    """Per-run output choices, carried in click's context object (never a global)."""

    json: bool = False
    command: str = ""
    config: str | None = None
    verbose: bool = False


@dataclass
class Result:
    """What a command returns: data for --json, lines for people."""

    data: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    ok: bool = True


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return _plain(asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def envelope(command: str, status: str, data: Any = None,
             errors: list[dict[str, Any]] | None = None) -> str:
    return json.dumps(
        {"version": ENVELOPE_VERSION, "command": command, "status": status,
         "data": _plain(data or {}), "errors": errors or []},
        indent=2, sort_keys=False,
    )


def emit(invocation: Invocation, result: Result) -> None:
    if invocation.json:
        print(envelope(invocation.command, "ok" if result.ok else "failed", result.data))
    else:
        for line in result.lines:  # names in them were escaped where they entered; this is
            print(safe_line(line))  # the last guard: no control character reaches a screen


def emit_error(invocation: Invocation, code: str, message: str, hint: str | None) -> None:
    if invocation.json:
        error = {"code": code, "message": message}
        if hint:
            error["hint"] = hint
        print(envelope(invocation.command, "error", errors=[error]))
    text = f"error: {message}" + (f" (hint: {hint})" if hint else "")
    print(safe_line(text), file=sys.stderr)
