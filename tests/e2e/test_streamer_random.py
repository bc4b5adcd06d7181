"""The streamer (enroot.flatten.streamer) against random layer stacks: on each, the one pass
writes the root the two passes write, refuses what they refuse, or asks for two passes.
Each stack starts decoder processes (most of its time), so this runs with the end-to-end
tests; the chosen scenarios stay in tests/unit/test_streamer.py."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from imgpipe.enroot.errors import HostileLayerError
from imgpipe.enroot.flatten.layerreader import LayerSource
from imgpipe.enroot.flatten.streamer import TwoPassesNeeded
from tests.hostile_layers import entry, layer
from tests.unit.test_streamer import DIR, LNK, SYM, one_pass, root_of, sources, two_passes


def _random_layers(rng: random.Random) -> list[bytes]:
    names = ["a", "b", "c"]
    blobs = []
    for _ in range(rng.randint(1, 4)):
        entries = []
        for _ in range(rng.randint(0, 7)):
            path = "/".join(rng.choice(names) for _ in range(rng.randint(1, 3)))
            parent, _, base = path.rpartition("/")
            kind = rng.choice("ffffddslwo")
            if kind == "f":
                entries.append(entry(path, data=rng.randbytes(rng.randint(0, 700))))
            elif kind == "d":
                entries.append(entry(path + "/", DIR))
            elif kind == "s":
                entries.append(entry(path, SYM, link=rng.choice(names)))
            elif kind == "l":
                entries.append(entry(path, LNK, link=rng.choice(names)))
            elif kind == "w":
                entries.append(entry(f"{parent}/.wh.{base}" if parent else f".wh.{base}"))
            else:
                entries.append(entry(f"{path}/.wh..wh..opq"))
        blobs.append(layer(*entries))
    return blobs


def test_random_layer_stacks_give_the_same_root_or_ask_for_two_passes(tmp_path: Path) -> None:
    rng = random.Random(2026)
    cases = [sources(tmp_path / f"case{case}", _random_layers(rng)) for case in range(48)]

    def outcome(layers: list[LayerSource]) -> str:
        try:
            expected: bytes | type[Exception] = two_passes(layers)
        except HostileLayerError:
            expected = HostileLayerError
        try:
            written = one_pass(layers)
        except TwoPassesNeeded:
            return "two"
        except HostileLayerError:
            return "refused" if expected is HostileLayerError else "one pass refused"
        if expected is HostileLayerError:
            return "one pass let it through"
        assert isinstance(expected, bytes)
        return "same" if root_of(written) == root_of(expected) else "different roots"

    # Each case starts decoder processes (most of its time): four at once on two cores.
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(outcome, cases))
    wrong = {case: found for case, found in enumerate(outcomes)
             if found not in ("same", "refused", "two")}
    assert wrong == {}
    same, refused = outcomes.count("same"), outcomes.count("refused")
    assert same >= 8 and refused >= 2, (same, refused)  # the one pass does the work
