"""Each layer rule has one home, enroot/layerrules.py: what a tar entry means is written there
and nowhere else in the converter, so a change to a rule is a change to that module only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from imgpipe.enroot import layerrules
from imgpipe.enroot.errors import HostileLayerError

ENROOT = Path(__file__).resolve().parents[2] / "enroot"
# The converter's modules, which read layers (the rest of enroot/ never looks into one).
CONVERTER = ["streamer", "viewwriter", "links", "view", "tarwriter", "tarreader",
             "layerreader", "decoder", "convert", "published", "publishedpolicy"]
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
                and module != "tarreader":  # the tar reader defines them
            found.append(f"line {node.lineno}: .{node.attr}()")
    return found


@pytest.mark.parametrize("module", CONVERTER)
def test_no_converter_module_spells_a_layer_rule_out(module: str) -> None:
    assert _spelled_rules(module) == [], f"enroot/{module}.py: ask enroot.layerrules instead"


def test_the_rules_module_does_spell_them_out() -> None:
    """The guard above would pass on modules that say nothing at all: the rules' own module
    must be where the words are."""
    found = " ".join(_spelled_rules("layerrules"))
    for word in (".wh.", ".wh..wh..opq", "dev/", "etc/hosts", "0o6000", ".ischr()",
                 ".islnk()"):
        assert word in found, word


def test_whiteouts_name_what_they_hide_and_refuse_other_names() -> None:
    assert layerrules.whiteout_of("etc/.wh.passwd", "L", "n") == ("etc/passwd", False)
    assert layerrules.whiteout_of("opt/.wh..wh..opq", "L", "n") == ("opt", True)
    assert layerrules.whiteout_of(".wh.top", "L", "n") == ("top", False)
    assert layerrules.whiteout_of("etc/passwd", "L", "n") is None
    for bad in ("etc/.wh.", "etc/.wh...", "etc/.wh..wh.x"):
        with pytest.raises(HostileLayerError, match="not a plain name"):
            layerrules.whiteout_of(bad, "L", bad)


def test_enroots_permission_fix() -> None:
    assert layerrules.fixed_mode("dir", 0o000) == 0o700
    assert layerrules.fixed_mode("file", 0o4111) == 0o4511
    assert layerrules.fixed_mode("symlink", 0o644) == 0o777
    assert layerrules.is_setid(0o2755) and not layerrules.is_setid(0o755)
