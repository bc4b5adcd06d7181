"""Dataset preparation (bert_trainer.dataset): format, statistics, corruption, Wikipedia
markup, sources.  Determinism across workers and tasks, and a killed run's resume (many
runs, processes killed): tests/e2e/test_dataset_runs.py; fidelity to the reference recipe,
shard counts and long documents: tests/e2e/test_dataset_fidelity.py."""

from __future__ import annotations

import bz2
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from xml.sax.saxutils import escape

import h5py
import numpy as np
import pytest
from bert_trainer.dataset.text import split_sentences
from bert_trainer.dataset.wiki import articles, clean_wikitext

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "nu", "pe", "ra", "su", "ti", "vo", "ze")
         for b in ("n", "r", "s", "t", "m", "l", "ko", "da", "be", "fi")]
PY = [sys.executable, "-m", "bert_trainer.dataset"]


def make_corpus(folder: Path, files: int = 3, documents: int = 40, seed: int = 7) -> Path:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"part{f}.txt", "w") as handle:
            for _ in range(documents):
                for _ in range(rng.randint(6, 14)):
                    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20)))
                    handle.write(words.capitalize() + ". ")
                    if rng.random() < 0.3:
                        handle.write("\n")
                handle.write("\n\n")
    return folder


def corpus_with_vocab(root: Path) -> tuple[Path, Path]:
    """The corpus of make_corpus in ``root`` and a vocabulary of 400 words trained on it."""
    source = make_corpus(root / "src")
    vocab = root / "vocab.txt"
    subprocess.run([*PY, "train-vocab", "--source", str(source), "--output", str(vocab),
                    "--vocab-size", "400"], check=True, capture_output=True, timeout=120)
    return source, vocab


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    return corpus_with_vocab(tmp_path_factory.mktemp("corpus"))


def prepare(source: Path, vocab: Path, output: Path, *extra: str, env=None) -> dict:
    result = subprocess.run([*PY, "prepare", "--source", str(source), "--output", str(output),
                             "--vocab", str(vocab), "--shards", "6", "--dupe-factor", "2",
                             *extra], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def digests(output: Path) -> dict[str, str]:
    return {str(p.relative_to(output)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(output.glob("phase*/*.hdf5"))}


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> tuple[dict, Path]:
    """One run with the defaults (its summary, its output), for the tests that read what it
    wrote; a test that changes the output changes its own copy."""
    source, vocab = corpus
    output = tmp_path_factory.mktemp("prepared") / "out"
    return prepare(source, vocab, output), output


def test_format_and_statistics(prepared) -> None:
    summary, out = prepared
    for phase, (seq, pred) in {"1": (128, 20), "2": (512, 80)}.items():
        stats = summary["phases"][phase]
        assert 0.14 <= stats["masked_fraction"] <= 0.17
        assert 0.75 <= stats["mask_token_share"] <= 0.85
        assert 0.07 <= stats["random_token_share"] <= 0.13
        assert 0.35 <= stats["random_next_fraction"] <= 0.65
        files = sorted((out / f"phase{phase}").glob("*.hdf5"))
        # NVIDIA's run_pretraining.py only loads files whose name holds "training".
        assert [p.name for p in files] == [f"training_shard_{i:05d}.hdf5" for i in range(6)]
        for path in files:
            with h5py.File(path) as f:
                n = f["input_ids"].shape[0]
                assert sorted(f) == sorted(["input_ids", "input_mask", "segment_ids",
                                            "masked_lm_positions", "masked_lm_ids",
                                            "next_sentence_labels"])
                shapes = {k: (f[k].shape, f[k].dtype) for k in f}
                assert shapes == {
                    "input_ids": ((n, seq), np.int32), "input_mask": ((n, seq), np.int8),
                    "segment_ids": ((n, seq), np.int8),
                    "masked_lm_positions": ((n, pred), np.int32),
                    "masked_lm_ids": ((n, pred), np.int32),
                    "next_sentence_labels": ((n,), np.int8)}
                assert all(f[k].compression == "gzip" for k in f)  # the default, as the reference
                ids, mask = f["input_ids"][()], f["input_mask"][()]
                segments = f["segment_ids"][()]
                positions, labels = f["masked_lm_positions"][()], f["masked_lm_ids"][()]
                assert (ids[:, 0] == 2).all()  # [CLS] of the trained vocabulary
                lengths = mask.sum(axis=1)
                assert (mask == (np.arange(seq)[None, :] < lengths[:, None])).all()
                assert (ids[mask == 0] == 0).all() and (segments[mask == 0] == 0).all()
                assert (ids[np.arange(n), lengths - 1] == 3).all()  # the final [SEP]
                used = (positions > 0).sum(axis=1)
                # The reference's count: 15 % of the whole sequence, [CLS] and [SEP] included.
                expected = np.minimum(pred, np.maximum(1, np.rint(lengths * 0.15)))
                assert (used == np.minimum(expected, lengths - 3)).all()
                for row in range(min(n, 50)):
                    chosen = positions[row][:used[row]]
                    assert list(chosen) == sorted(chosen) and (chosen > 0).all()
                    assert (positions[row][used[row]:] == 0).all()  # first 0 ends the list
                    assert (labels[row][used[row]:] == 0).all()
                    first_sep = int(np.argmax(segments[row])) - 1
                    assert not {0, first_sep, lengths[row] - 1} & set(chosen.tolist())


def test_corrupt_shard_is_detected_and_redone(corpus, prepared, tmp_path: Path) -> None:
    source, vocab = corpus
    out = tmp_path / "out"
    shutil.copytree(prepared[1], out)  # a run with the defaults, as the other tests read it
    before = digests(out)
    victim = out / "phase2" / "training_shard_00003.hdf5"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    (out / "phase1" / "training_shard_00001.hdf5").unlink()
    result = subprocess.run([*PY, "prepare", "--source", str(source), "--output", str(out),
                             "--vocab", str(vocab), "--shards", "6", "--dupe-factor", "2",
                             "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0
    shards_line = next(json.loads(x) for x in result.stdout.splitlines() if '"shards"' in x)
    assert shards_line["done"] == 2 and shards_line["skipped"] == 4
    assert shards_line["tokenized"] == 0  # the token store was intact
    assert digests(out) == before


ALPHA = """
{{Infobox thing|name=Alpha|{{nested|x}}}}
'''Alpha''' is a [[Greek alphabet|letter]] of the [[alphabet]].<ref>A source.</ref> It came
first.<ref name="b"/> See [http://example.org the site].
== History ==
{| class="wikitable"
| cell || {{tpl}}
|}
* a list item that should go
Alpha was used by Mr. Smith in 1900. It is still used today &amp; tomorrow.
[[File:Alpha.png|thumb|A [[picture]] caption]]
<!-- a hidden comment -->
[[Category:Letters]]
"""
GAMMA = "'''Gamma''' is the third letter. It follows beta.\n\nGamma rays are ''energetic''."


def page(title: str, namespace: int, body: str, redirect: bool = False) -> str:
    # Dumps escape the wikitext inside <text>, as any XML writer must.
    marker = f'<redirect title="{escape(body)}"/>' if redirect else ""
    return (f"  <page><title>{escape(title)}</title><ns>{namespace}</ns>{marker}"
            f"<revision><text>{escape(body)}</text></revision></page>\n")


DUMP = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">\n'
        + page("Alpha", 0, ALPHA) + page("Beta", 0, "#REDIRECT [[Alpha]]", redirect=True)
        + page("Talk:Alpha", 1, "Talk text.") + page("Gamma", 0, GAMMA) + "</mediawiki>\n")


def test_wikipedia_markup_is_removed(tmp_path: Path) -> None:
    dump = tmp_path / "dump.xml.bz2"
    dump.write_bytes(bz2.compress(DUMP.encode()))
    found = list(articles(dump))
    assert [title for title, _ in found] == ["Alpha", "Gamma"]
    text = " ".join(found[0][1])
    assert text.startswith("Alpha is a letter of the alphabet. It came first. See the site.")
    assert "Alpha was used by Mr. Smith in 1900. It is still used today & tomorrow." in text
    for junk in ("{{", "}}", "[[", "<ref", "Infobox", "wikitable", "cell", "list item",
                 "History", "hidden comment", "Category", "caption", "'''", "http"):
        assert junk not in text, junk
    assert found[1][1] == ["Gamma is the third letter. It follows beta.",
                           "Gamma rays are energetic."]
    assert split_sentences(found[0][1][-1])[0] == "Alpha was used by Mr. Smith in 1900."


def test_wikipedia_dump_to_shards(tmp_path: Path, corpus) -> None:
    _, vocab = corpus
    dump = tmp_path / "dump.xml.bz2"
    dump.write_bytes(bz2.compress(DUMP.encode()))
    summary = prepare(dump, vocab, tmp_path / "out")
    assert summary["documents"] == 2 and summary["phases"]["1"]["instances"] > 0


def test_clean_wikitext_nested_templates() -> None:
    assert clean_wikitext("A {{a|{{b|{{c}}}}}} B.") == ["A B."]


def test_download_resumes_a_partial_file(tmp_path: Path) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bert_trainer.dataset.text import download

    payload = bz2.compress(DUMP.encode()) * 50
    ranges_seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            wanted = self.headers.get("Range")
            ranges_seen.append(wanted)
            start = int(wanted.split("=")[1].rstrip("-")) if wanted else 0
            body = payload[start:]
            self.send_response(206 if wanted else 200)
            if wanted:
                self.send_header("Content-Range",
                                 f"bytes {start}-{len(payload) - 1}/{len(payload)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/enwiki.xml.bz2"
        dest = tmp_path / "enwiki.xml.bz2"
        dest.with_name(dest.name + ".part").write_bytes(payload[:1000])  # an earlier attempt
        download(url, dest)
    finally:
        server.shutdown()
        server.server_close()
    assert dest.read_bytes() == payload
    assert ranges_seen == ["bytes=1000-"]
    assert not dest.with_name(dest.name + ".part").exists()


def test_text_shards_are_balanced(prepared) -> None:
    sizes = [p.stat().st_size for p in sorted((prepared[1] / "text").glob("shard_*.txt"))]
    assert len(sizes) == 6 and max(sizes) <= 1.2 * min(sizes)
