"""Text for a terminal: what other users chose (file names, lock holders, registry text)
passes through :func:`shown` before it reaches anyone's screen, root's included.

``shown`` escapes everything but printable ASCII, so no control sequence (an ESC that retitles
the terminal, moves the cursor or rewrites an earlier line) and no newline (a forged line of
output) survives.  :func:`safe_line` is the renderer's last guard over whole lines of output:
control characters are escaped there too, while the program's own Unicode stays as it is.
"""

from __future__ import annotations

__all__ = ["safe_line", "shown"]

_CONTROLS = {c: c.encode("unicode_escape").decode("ascii")
             for c in [*map(chr, range(0x20)), "\x7f", *map(chr, range(0x80, 0xA0))]}
_CONTROLS["\t"] = "\t"
_GUARD = str.maketrans(_CONTROLS)


def shown(text: str, limit: int = 160) -> str:
    """Text another user wrote, safe for a terminal: anything but printable ASCII escaped
    (no control sequence reaches the screen), a backslash doubled (so an escape cannot be
    forged by typing one), cut at ``limit`` characters."""
    out = "".join(c if " " <= c <= "~" and c != "\\" else
                  c.encode("unicode_escape").decode("ascii") for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


def safe_line(line: str) -> str:
    """A line of output with every control character but tab escaped."""
    return line.translate(_GUARD)
