"""imgpipe.yaml's layers: where sites, users and projects keep it, merged key by key, and
validated against the schema (``imgpipe.base.config``) once per file and once merged.

Layers, each overriding the one before it key by key (a mapping merges, anything else is
replaced):

1. the site's ``/etc/imgpipe/imgpipe.yaml`` (what an admin installs on every host);
2. the user's ``$XDG_CONFIG_HOME/imgpipe/imgpipe.yaml`` (``~/.config/imgpipe/imgpipe.yaml``);
3. the project's ``imgpipe.yaml``, the nearest one above the working directory;
4. the file ``--config`` or ``IMGPIPE_CONFIG`` names.

With no file at all imgpipe works on one machine: a registry on 127.0.0.1:5000 and every
output under ``./build``.  Relative paths in a file are relative to that file's folder; the
defaults' to the project's (or ``--config``'s) folder, else the working directory.  Errors
name the file, the key and what is wrong, e.g. ``imgpipe.yaml: registry.port: must be an
integer``.  What the threat model trusts (``TRUSTED_KEYS``) comes only from a file root owns
and nobody else may write; a user's layer that sets it is refused in one line.  The Pyxis
importer and the cache writer read one file (``IMGPIPE_CONFIG``, ``--config`` or the site's),
never a user's or a project's layer: ``parse_settings``.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from imgpipe.base.config import TRUSTED_KEYS, Settings, format_validation_error
from imgpipe.base.errors import ConfigError

CONFIG_NAME = "imgpipe.yaml"
SITE_CONFIG = Path("/etc/imgpipe/imgpipe.yaml")


def find_config(start: Path) -> Path | None:
    """The nearest imgpipe.yaml in ``start`` or a parent folder, or None."""
    for folder in (start, *start.parents):
        candidate = folder / CONFIG_NAME
        try:
            if candidate.is_file():
                return candidate
        except PermissionError:  # a folder closed to this account (root's home for sudo -u)
            continue
    return None


def user_config(environ: dict[str, str] | None = None) -> Path:
    """The user's layer: ``$XDG_CONFIG_HOME/imgpipe/imgpipe.yaml``."""
    environ = dict(os.environ) if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "imgpipe" / CONFIG_NAME


def config_files(explicit: str | os.PathLike[str] | None = None, cwd: Path | None = None,
                 site: Path = SITE_CONFIG, user: Path | None = None) -> list[Path]:
    """The files that configure a run, lowest layer first (site, user, project, explicit)."""
    cwd = (cwd or Path.cwd()).resolve()
    found = [path for path in (site, user or user_config()) if path.is_file()]
    project = find_config(cwd)
    if project is not None:
        found.append(project)
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file", hint="check --config")
        found.append(path)
    unique: list[Path] = []
    for path in found:  # the same file twice (--config naming the project's) counts once
        if all(not path.samefile(seen) for seen in unique):
            unique.append(path)
    return unique


def load_settings(
    explicit: str | os.PathLike[str] | None = None, cwd: Path | None = None,
    site: Path = SITE_CONFIG, user: Path | None = None,
) -> Settings:
    """The merged configuration of every layer (see the module's docstring)."""
    cwd = (cwd or Path.cwd()).resolve()
    files = config_files(explicit, cwd, site, user)
    merged: dict[str, object] = {}
    origins: dict[str, str] = {}
    for path in files:
        raw = _read(path)
        parse_settings(path, raw)  # each file valid on its own: errors name the file
        _merge(merged, _absolute_paths(raw, path.parent.resolve()), origins, str(path), "")
    chosen = [p for p in files if p not in (site, user or user_config())]
    root = chosen[-1].parent.resolve() if chosen else cwd
    try:
        return Settings.model_validate({**merged, "root": root, "origins": origins,
                                        "source": files[-1] if files else None})
    except ValidationError as exc:  # each layer was valid: only their sum can fail here
        raise ConfigError(format_validation_error(Path(files[-1]), exc)) from exc


def _merge(into: dict[str, object], layer: dict[str, object], origins: dict[str, str],
           source: str, prefix: str) -> None:
    for key, value in layer.items():
        dotted = f"{prefix}{key}"
        current = into.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            merged = dict(current)
            _merge(merged, value, origins, source, dotted + ".")
            into[key] = merged
            continue
        into[key] = value
        for known in [k for k in origins if k == dotted or k.startswith(dotted + ".")]:
            del origins[known]
        if isinstance(value, dict):
            _merge({}, value, origins, source, dotted + ".")
            if not value:
                origins[dotted] = source
        else:
            origins[dotted] = source


def _path_keys(model: type[BaseModel] | None = None, prefix: str = "") -> set[str]:
    """The dotted keys whose values are paths (relative ones resolve against their file)."""
    model = model or Settings
    found = set()
    for name, field in model.model_fields.items():
        if field.exclude:
            continue
        annotation = field.annotation
        args = getattr(annotation, "__args__", ()) or (annotation,)
        if any(isinstance(arg, type) and issubclass(arg, BaseModel) for arg in args):
            sub = next(arg for arg in args if isinstance(arg, type) and issubclass(arg, BaseModel))
            found |= _path_keys(sub, f"{prefix}{name}.")
        elif any(arg is Path for arg in args):
            found.add(f"{prefix}{name}")
    return found


def _absolute_paths(raw: dict[str, object], folder: Path, prefix: str = ""
                    ) -> dict[str, object]:
    out: dict[str, object] = {}
    paths = _path_keys()
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = _absolute_paths(value, folder, dotted + ".")
        elif dotted in paths and isinstance(value, str) and value and not os.path.isabs(value):
            out[key] = str(folder / value)
        else:
            out[key] = value
    return out


def _read(path: Path) -> dict[str, object]:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a mapping of keys to values")
    for reserved in ("root", "source", "origins"):
        if reserved in raw:
            raise ConfigError(f"{path}: {reserved}: unknown key")
    _check_trusted(path, raw)
    return raw


def _check_trusted(path: Path, raw: dict[str, object]) -> None:
    """Refuse a key the threat model trusts from a file a job user could have written."""
    for dotted in TRUSTED_KEYS:
        section, _, key = dotted.partition(".")
        values = raw.get(section)
        if not isinstance(values, dict) or values.get(key) is None:
            continue
        info = path.stat()
        if info.st_uid != 0 or info.st_mode & 0o022:
            raise ConfigError(
                f"{path}: {dotted}: only a file root owns and nobody else may write may set it "
                f"(this one: uid {info.st_uid}, mode {info.st_mode & 0o7777:04o})",
                hint="set it in the site's /etc/imgpipe/imgpipe.yaml")


def parse_settings(path: Path, raw: dict[str, object] | None = None) -> Settings:
    """One config file alone, every problem a ConfigError naming it (the importer and the
    cache writer read one file; ``load_settings`` checks each layer with it)."""
    raw = _read(path) if raw is None else raw
    try:
        return Settings.model_validate({**raw, "root": path.parent.resolve(), "source": path,
                                        "origins": {key: str(path) for key in _leaves(raw)}})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(path, exc)) from exc


def _leaves(raw: dict[str, object], prefix: str = "") -> list[str]:
    keys = []
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            keys += _leaves(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys
