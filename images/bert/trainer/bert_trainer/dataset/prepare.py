"""The dataset job: source -> text shards -> tokens -> HDF5 instances for phase 1 and 2.

Work is split by shard index across Slurm tasks (``SLURM_PROCID`` of
``SLURM_NTASKS``) and local processes (``--workers``).  Every output is
written under a temporary name and renamed, and listed with its sha256 in a
per-shard record; a re-run skips shards whose files match their record and
redoes missing or broken ones.  Task 0 makes the text shards (others wait for
``text/manifest.json``) and writes ``summary.json`` at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from multiprocessing import get_context
from pathlib import Path

PHASES = {1: (128, 20), 2: (512, 80)}
WAIT_S = 48 * 3600


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}.{socket.gethostname()}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _documents(source: str, output: Path):
    from bert_trainer.dataset import text, wiki

    if source.startswith(("http://", "https://")):
        (output / "source").mkdir(parents=True, exist_ok=True)
        local = text.download(source, output / "source" / source.rstrip("/").rsplit("/", 1)[-1])
    else:
        local = Path(source)
    if local.is_dir():
        yield from text.text_documents(local)
    elif local.suffix in (".bz2", ".xml"):
        for _title, paragraphs in wiki.articles(local):
            yield paragraphs
    else:
        raise SystemExit(f"error: {source}: give a folder of .txt files or a Wikipedia .xml/.bz2")


def make_text_shards(source: str, output: Path, shards: int) -> dict:
    """Split the source into ``shards`` balanced text shards (one sentence a line)."""
    from bert_trainer.dataset.text import split_sentences

    folder = output / "text"
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(".tmp-*"):  # an interrupted earlier attempt
        leftover.unlink()
    started = time.perf_counter()
    names = [folder / f"shard_{i:05d}.txt" for i in range(shards)]
    tmps = [n.with_name(f".tmp-{n.name}.{os.getpid()}") for n in names]
    handles = [open(t, "w", encoding="utf-8") for t in tmps]
    sizes = [0] * shards
    documents = sentences = 0
    try:
        for document in _documents(source, output):
            lines = [s for paragraph in document for s in split_sentences(paragraph)]
            if not lines:
                continue
            target = min(range(shards), key=lambda i: (sizes[i], i))
            handles[target].write("\n".join(lines) + "\n\n")
            sizes[target] += sum(len(s) for s in lines)
            documents += 1
            sentences += len(lines)
    finally:
        for handle in handles:
            handle.close()
    for tmp, name in zip(tmps, names, strict=True):
        os.replace(tmp, name)
    manifest = {"shards": shards, "documents": documents, "sentences": sentences,
                "bytes": sum(sizes), "seconds": round(time.perf_counter() - started, 3),
                "files": {n.name: sha256(n) for n in names}}
    _atomic_text(folder / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def _read_shard(path: Path) -> list[list[str]]:
    documents, current = [], []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line:
            current.append(line)
        elif current:
            documents.append(current)
            current = []
    if current:
        documents.append(current)
    return documents


def _record_ok(record_path: Path, output: Path) -> bool:
    try:
        record = json.loads(record_path.read_text())
        return all(sha256(output / name) == digest for name, digest in record["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def process_shard(job: tuple) -> dict:
    """Tokenize one text shard and write its HDF5 files for every phase (or skip if valid)."""
    index, output, vocab, seed, dupe_factor, phases = job
    import numpy as np
    from tokenizers import BertWordPieceTokenizer

    from bert_trainer.dataset import hdf5
    from bert_trainer.dataset.instances import Params, Specials, build, rng_for

    record_path = output / "records" / f"shard_{index:05d}.json"
    if _record_ok(record_path, output):
        return {"shard": index, "skipped": True}
    # Leftovers of an interrupted run of this shard (one worker owns a shard at a time).
    for leftover in output.glob(f"*/.tmp-shard_{index:05d}.*"):
        leftover.unlink(missing_ok=True)
    times = {}
    started = time.perf_counter()
    tokenizer = BertWordPieceTokenizer(str(vocab), lowercase=True)
    documents = _read_shard(output / "text" / f"shard_{index:05d}.txt")
    flat = [s for d in documents for s in d]
    encoded = tokenizer.encode_batch(flat, add_special_tokens=False) if flat else []
    ids = [np.asarray(e.ids, np.int32) for e in encoded]
    tokenized, cursor = [], 0
    for document in documents:
        sentences = [x for x in ids[cursor:cursor + len(document)] if len(x)]
        cursor += len(document)
        if sentences:
            tokenized.append(sentences)
    times["tokenize_s"] = round(time.perf_counter() - started, 3)
    special = {t: tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[UNK]")}
    specials = Specials(special["[CLS]"], special["[SEP]"], special["[MASK]"],
                        tokenizer.get_vocab_size(), max(special.values()) + 1)
    record = {"shard": index, "documents": len(tokenized),
              "sentences": sum(len(d) for d in tokenized),
              "tokens": int(sum(len(x) for d in tokenized for x in d)), "files": {},
              "phases": {}}
    for phase in phases:
        seq_len, max_pred = PHASES[phase]
        started = time.perf_counter()
        params = Params(seq_len, max_pred, dupe_factor=dupe_factor, seed=seed)
        made = build(tokenized, params, specials, rng_for(seed, index, seq_len))
        made_s = time.perf_counter() - started
        started = time.perf_counter()
        folder = output / f"phase{phase}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"shard_{index:05d}.hdf5"
        hdf5.write(made, path)
        record["files"][f"phase{phase}/{path.name}"] = sha256(path)
        record["phases"][str(phase)] = {
            "instances": int(made.input_ids.shape[0]), "masked_tokens": made.masked_tokens,
            "real_tokens": made.real_tokens, "as_mask": made.masked_as_mask,
            "as_random": made.masked_as_random,
            "random_next": int(made.next_sentence_labels.sum()),
            "instances_s": round(made_s, 3), "write_s": round(time.perf_counter() - started, 3)}
    record["tokenize_s"] = times["tokenize_s"]
    record_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_text(record_path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def summarize(output: Path, shards: int) -> dict:
    records = [json.loads((output / "records" / f"shard_{i:05d}.json").read_text())
               for i in range(shards)]
    text = json.loads((output / "text" / "manifest.json").read_text())
    summary = {"documents": text["documents"], "sentences": text["sentences"],
               "text_bytes": text["bytes"], "text_s": text["seconds"],
               "tokens": sum(r["tokens"] for r in records),
               "tokenize_s": round(sum(r["tokenize_s"] for r in records), 3), "phases": {}}
    for phase in sorted({p for r in records for p in r["phases"]}):
        rows = [r["phases"][phase] for r in records if phase in r["phases"]]
        instances = sum(x["instances"] for x in rows)
        masked = sum(x["masked_tokens"] for x in rows)
        summary["phases"][phase] = {
            "instances": instances,
            "instances_per_shard": [x["instances"] for x in rows],
            "masked_fraction": round(masked / max(1, sum(x["real_tokens"] for x in rows)), 4),
            "mask_token_share": round(sum(x["as_mask"] for x in rows) / max(1, masked), 4),
            "random_token_share": round(sum(x["as_random"] for x in rows) / max(1, masked), 4),
            "random_next_fraction": round(sum(x["random_next"] for x in rows)
                                          / max(1, instances), 4),
            "instances_s": round(sum(x["instances_s"] for x in rows), 3),
            "write_s": round(sum(x["write_s"] for x in rows), 3)}
    _atomic_text(output / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"error: gave up waiting for {what} ({path})")
        time.sleep(1.0)


def prepare(args: argparse.Namespace) -> int:
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    manifest = output / "text" / "manifest.json"
    if rank == 0 and not manifest.exists():
        made = make_text_shards(args.source, output, args.shards)
        print(json.dumps({"stage": "text", **{k: v for k, v in made.items() if k != "files"}}),
              flush=True)
    _wait_for(manifest, "the text shards task 0 makes")
    shards = json.loads(manifest.read_text())["shards"]
    mine = [i for i in range(shards) if i % tasks == rank]
    phases = tuple(int(p) for p in args.phases.split(","))
    jobs = [(i, output, Path(args.vocab), args.seed, args.dupe_factor, phases) for i in mine]
    if args.workers > 1 and len(jobs) > 1:
        with get_context("fork").Pool(args.workers) as pool:
            done = pool.map(process_shard, jobs, chunksize=1)
    else:
        done = [process_shard(job) for job in jobs]
    skipped = sum(1 for d in done if d.get("skipped"))
    print(json.dumps({"stage": "shards", "rank": rank, "done": len(done) - skipped,
                      "skipped": skipped}), flush=True)
    if rank == 0:
        for i in range(shards):
            _wait_for(output / "records" / f"shard_{i:05d}.json", f"shard {i}")
        print(json.dumps({"stage": "summary", **summarize(output, shards)}), flush=True)
    return 0


def train_vocab(args: argparse.Namespace) -> int:
    from tokenizers import BertWordPieceTokenizer

    output = Path(args.output)
    work = output.parent / f".tmp-vocab-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    with open(corpus, "w", encoding="utf-8") as handle:
        for document in _documents(args.source, work):
            handle.write("\n".join(document) + "\n")
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train([str(corpus)], vocab_size=args.vocab_size, min_frequency=2,
                    special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tokenizer.save_model(str(work))
    os.replace(work / "vocab.txt", output)
    for leftover in work.iterdir():
        leftover.unlink()
    work.rmdir()
    print(json.dumps({"vocab": str(output), "size": tokenizer.get_vocab_size()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_trainer.dataset",
                                     description="BERT pre-training data preparation")
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="source -> sharded HDF5 instances (resumable)")
    prep.add_argument("--source", required=True,
                      help="a folder of .txt files, a Wikipedia .xml/.bz2 dump, or its URL")
    prep.add_argument("--output", required=True)
    prep.add_argument("--vocab", required=True, help="WordPiece vocab.txt")
    prep.add_argument("--shards", type=int, default=256)
    prep.add_argument("--seed", type=int, default=12345)
    prep.add_argument("--dupe-factor", type=int, default=5)
    prep.add_argument("--phases", default="1,2")
    prep.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    vocab = commands.add_parser("train-vocab", help="train a WordPiece vocabulary")
    vocab.add_argument("--source", required=True)
    vocab.add_argument("--output", required=True)
    vocab.add_argument("--vocab-size", type=int, default=30522)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        if not Path(args.vocab).is_file():
            parser.error(f"--vocab {args.vocab} does not exist (train one: train-vocab)")
        return prepare(args)
    return train_vocab(args)


if __name__ == "__main__":
    sys.exit(main())
