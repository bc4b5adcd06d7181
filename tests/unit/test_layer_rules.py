"""Each layer rule has one home, enroot/flatten/rules.py: what a tar entry means is written there
and nowhere else in the converter, so a change to a rule is a change to that module only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from imgpipe.enroot.errors import HostileLayerError
from imgpipe.enroot.flatten import rules

ENROOT = Path(__file__).resolve().parents[2] / "enroot"
# The modules that read layers: every module of the flattener but the rules' own, and those
# that check a published squashfs against them (the rest of enroot/ never looks into one).
CONVERTER = sorted(f"flatten/{path.stem}" for path in (ENROOT / "flatten").glob("*.py")
                   if path.stem not in ("__init__", "rules")) \
    + ["convert", "published/artifact", "published/policy"]
# What spells a rule out: whiteout and opaque names, the dropped folder, the set-id bits,
# the runtimes' mount points, the entry kinds tar flags.
RULE_WORDS = {".wh.", ".wh..wh..opq", "dev/", "etc/hosts", "etc/resolv.conf"}
RULE_NUMBERS = {0o6000}
KIND_TESTS = {"ischr", "isblk", "isfifo", "issym", "islnk", "isdir", "isfile"}


def _spelled_rules(module: str) -> list[str]:
    tree = ast.parse((ENROOT / f"{module}.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in RULE_WORDS:
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Constant) and type(node.value) is int \
                and node.value in RULE_NUMBERS:
            found.append(f"line {node.lineno}: {oct(node.value)}")
        elif isinstance(node, ast.Attribute) and node.attr in KIND_TESTS \
                and module != "flatten/tarreader":  # the tar reader defines them
            found.append(f"line {node.lineno}: .{node.attr}()")
    return found


@pytest.mark.parametrize("module", CONVERTER)
def test_no_converter_module_spells_a_layer_rule_out(module: str) -> None:
    assert _spelled_rules(module) == [], f"enroot/{module}.py: ask enroot.flatten.rules instead"


def test_the_rules_module_does_spell_them_out() -> None:
    """The guard above would pass on modules that say nothing at all: the rules' own module
    must be where the words are."""
    found = " ".join(_spelled_rules("flatten/rules"))
    for word in (".wh.", ".wh..wh..opq", "dev/", "etc/hosts", "0o6000", ".ischr()",
                 ".islnk()"):
        assert word in found, word


def test_whiteouts_name_what_they_hide_and_refuse_other_names() -> None:
    assert rules.whiteout_of("etc/.wh.passwd", "L", "n") == ("etc/passwd", False)
    assert rules.whiteout_of("opt/.wh..wh..opq", "L", "n") == ("opt", True)
    assert rules.whiteout_of(".wh.top", "L", "n") == ("top", False)
    assert rules.whiteout_of("etc/passwd", "L", "n") is None
    for bad in ("etc/.wh.", "etc/.wh...", "etc/.wh..wh.x"):
        with pytest.raises(HostileLayerError, match="not a plain name"):
            rules.whiteout_of(bad, "L", bad)


def test_enroots_permission_fix() -> None:
    assert rules.fixed_mode("dir", 0o000) == 0o700
    assert rules.fixed_mode("file", 0o4111) == 0o4511
    assert rules.fixed_mode("symlink", 0o644) == 0o777
    assert rules.is_setid(0o2755) and not rules.is_setid(0o755)
