"""`imgpipe config show`: every effective key, its value, and the file that set it."""

from __future__ import annotations

from dataclasses import dataclass

from imgpipe.base.config import Settings
from imgpipe.base.configcheck import conflicts
from imgpipe.base.configlayers import parse_settings

__all__ = ["Key", "conflicts", "effective_keys", "parse_settings"]


@dataclass(frozen=True)
class Key:
    key: str  # dotted: registry.host
    value: object
    origin: str  # the file that set it, or "default"


def effective_keys(settings: Settings) -> list[Key]:
    """Every key the configuration has, leaves only, in the model's order."""
    found: list[Key] = []

    def walk(values: dict[str, object], prefix: str) -> None:
        for name, value in values.items():
            dotted = f"{prefix}{name}"
            if isinstance(value, dict) and value and not _is_free_mapping(dotted):
                walk(value, dotted + ".")
            else:
                found.append(Key(dotted, value, _origin(settings, dotted)))

    walk(settings.model_dump(mode="json"), "")
    return found


def _is_free_mapping(dotted: str) -> bool:
    """Mappings whose keys are the user's (build.builders, a profile's env): one key each."""
    return dotted in ("build.builders",)


def _origin(settings: Settings, dotted: str) -> str:
    if dotted in settings.origins:
        return settings.origins[dotted]
    below = [origin for key, origin in settings.origins.items() if key.startswith(dotted + ".")]
    return below[-1] if below else "default"
