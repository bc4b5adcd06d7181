"""The dataset job: source -> text shards -> token store -> HDF5 instances for phase 1 and 2.

Three stages, each resumable:

1. text (task 0): documents streamed from the source, split into sentences, dealt to text
   shards balanced by size; ``text/manifest.json`` marks it done.
2. tokens (every task): each text shard tokenized once into the token store
   (``tokens/``, see tokens.py), for every phase.
3. instances (every task, once every shard is tokenized, since a random "next" segment may
   come from any document of the corpus): each shard's pairs, rows and masks, written as
   ``phaseN/training_shard_NNNNN.hdf5`` (NVIDIA's trainer loads files named ``*training*``).

Work is split by shard index across Slurm tasks (``SLURM_PROCID`` of ``SLURM_NTASKS``) and
local processes (``--workers``); the output is the same bytes for any split.  Every file is
written under a temporary name and renamed, and listed with its sha256 in a record
(``records/``); a re-run skips what matches its record and redoes what is missing or broken.
Progress goes to stdout as JSON lines, at most one a second per stage, then a summary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import sys
import time
from multiprocessing import get_context
from pathlib import Path

PHASES = {1: (128, 20), 2: (512, 80)}
WAIT_S = 48 * 3600
SHARD_BYTES = 1 << 20  # default shard size: about 1 MiB of text
MIN_DOCUMENTS = 4  # ... and never fewer documents than this per shard
MAX_SHARDS = 4096
BLOCK_BYTES = 4 << 20  # rows masked at once: about this much of (int64) gather indexes


class Progress:
    """JSON progress lines for one stage, at most one a second, then a final one."""

    def __init__(self, stage: str, interval_s: float = 1.0) -> None:
        self.stage, self.interval_s = stage, interval_s
        self.last = time.monotonic()

    def tick(self, **counts: object) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval_s:
            self.last = now
            print(json.dumps({"progress": self.stage, **counts}), flush=True)


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started (VmHWM: unlike getrusage's
    ru_maxrss, it does not carry the high-water mark of whatever ran before exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def _with_peak(result: dict) -> dict:
    return {**result, "peak_rss_mb": peak_rss_mb()}


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
        if not text.text_files(local):
            raise SystemExit(f"error: --source {source}: no .txt (.txt.gz, .txt.bz2, .txt.xz) "
                             "file in this folder")
        yield from text.text_documents(local)
    elif local.is_file():
        try:
            dump = text.is_wikipedia_dump(local)
        except ValueError as exc:
            raise SystemExit(f"error: --source {exc}") from None
        if dump:
            for _title, paragraphs in wiki.articles(local):
                yield paragraphs
        else:
            yield from text.file_documents(local)
    else:
        raise SystemExit(f"error: --source {source}: no such file or folder (give a folder of "
                         ".txt files, one text file (.txt, .gz, .bz2, .xz) or a Wikipedia dump)")


def default_shards(text_bytes: int, documents: int) -> int:
    """About 1 MiB of text a shard, at least 8 shards where the documents allow, never fewer
    than MIN_DOCUMENTS documents a shard, at most MAX_SHARDS."""
    by_size = max(8, math.ceil(text_bytes / SHARD_BYTES))
    return max(1, min(by_size, documents // MIN_DOCUMENTS, MAX_SHARDS))


def make_text_shards(source: str, output: Path, shards: int | None) -> dict:
    """Split the source into text shards (one sentence a line, a blank line between
    documents), balanced by size; ``text/documents.npy`` says where each document went."""
    import numpy as np

    from bert_trainer.dataset.text import split_sentences
    from bert_trainer.dataset.tokens import save_array

    folder = output / "text"
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(".tmp-*"):  # an interrupted earlier attempt
        leftover.unlink()
    started = time.perf_counter()
    progress = Progress("text")
    # First into one spool file: the shard count may depend on the size.
    spool = folder / f".tmp-spool.{os.getpid()}"
    sizes_of_documents: list[int] = []
    sentences = written = 0
    with open(spool, "w", encoding="utf-8") as handle:
        for document in _documents(source, output):
            lines = [s for paragraph in document for s in split_sentences(paragraph)]
            if not lines:
                continue
            block = "\n".join(lines) + "\n\n"
            handle.write(block)
            sizes_of_documents.append(len(block))
            sentences += len(lines)
            written += len(block)
            progress.tick(documents=len(sizes_of_documents), sentences=sentences,
                          megabytes=round(written / 1e6, 1))
    total = written
    if not sizes_of_documents:
        spool.unlink()
        raise SystemExit(f"error: --source {source}: no text found")
    if shards is None:
        shards = default_shards(total, len(sizes_of_documents))
    names = [folder / f"shard_{i:05d}.txt" for i in range(shards)]
    tmps = [n.with_name(f".tmp-{n.name}.{os.getpid()}") for n in names]
    handles = [open(t, "w", encoding="utf-8") for t in tmps]
    filled = [0] * shards
    counts = [0] * shards
    placement = np.zeros((len(sizes_of_documents), 2), np.int32)
    try:
        with open(spool, encoding="utf-8") as reader:
            for number, size in enumerate(sizes_of_documents):
                block = []
                while line := reader.readline():
                    block.append(line)
                    if line == "\n":
                        break
                target = min(range(shards), key=lambda i: (filled[i], i))
                handles[target].write("".join(block))
                filled[target] += size
                placement[number] = (target, counts[target])
                counts[target] += 1
    finally:
        for handle in handles:
            handle.close()
    spool.unlink()
    for tmp, name in zip(tmps, names, strict=True):
        os.replace(tmp, name)
    save_array(folder / "documents.npy", placement)
    manifest = {"shards": shards, "documents": len(sizes_of_documents), "sentences": sentences,
                "bytes": total, "seconds": round(time.perf_counter() - started, 3),
                "files": {n.name: sha256(n) for n in names},
                "documents.npy": sha256(folder / "documents.npy")}
    _atomic_text(folder / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def _read_shard(path: Path) -> list[list[str]]:
    documents, current = [], []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.rstrip("\n")
            if line:
                current.append(line)
            elif current:
                documents.append(current)
                current = []
    if current:
        documents.append(current)
    return documents


def _record_ok(record_path: Path, output: Path, params: dict | None = None) -> bool:
    try:
        record = json.loads(record_path.read_text())
        if params is not None and record.get("params") != params:
            return False
        return all(sha256(output / name) == digest for name, digest in record["files"].items())
    except (OSError, ValueError, KeyError):
        return False


_TOKENIZERS: dict[str, object] = {}


def _encoder(vocab: Path):
    """One tokenizer per process (loading the vocabulary is the costly part)."""
    key = str(vocab)
    if key not in _TOKENIZERS:
        from tokenizers import BertWordPieceTokenizer

        _TOKENIZERS[key] = BertWordPieceTokenizer(key, lowercase=True)._tokenizer
    tokenizer = _TOKENIZERS[key]

    def encode(lines: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch_fast(lines, add_special_tokens=False)]

    return encode, tokenizer.get_vocab_size()


def tokenize_shard(job: tuple) -> dict:
    """Stage 2 for one shard: its text -> the token store (or skip if valid)."""
    index, output, vocab = job
    from bert_trainer.dataset import tokens

    record_path = output / "records" / f"tokens_{index:05d}.json"
    params = {"vocab": sha256(Path(vocab))}
    if _record_ok(record_path, output, params):
        return _with_peak({"shard": index, "skipped": True})
    started = time.perf_counter()
    encode, vocab_size = _encoder(Path(vocab))
    documents = _read_shard(output / "text" / f"shard_{index:05d}.txt")
    shard = tokens.tokenize(documents, encode, vocab_size)
    written = tokens.save(output / "tokens", index, shard)
    record = {"shard": index, "params": params, "documents": shard.document_count,
              "sentences": len(shard.sentences) - 1, "tokens": len(shard.tokens),
              "files": {str(p.relative_to(output)): sha256(p) for p in written.values()},
              "tokenize_s": round(time.perf_counter() - started, 3)}
    record_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_text(record_path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return _with_peak(record)


def specials_of(vocab: Path):
    from bert_trainer.dataset.instances import Specials

    words = vocab.read_text(encoding="utf-8").splitlines()
    ids = {word.strip(): i for i, word in enumerate(words)}
    missing = [t for t in ("[CLS]", "[SEP]", "[MASK]") if t not in ids]
    if missing:
        raise SystemExit(f"error: --vocab {vocab} has no {', '.join(missing)} token")
    return Specials(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], len(words))


def instances_shard(job: tuple) -> dict:
    """Stage 3 for one shard: its HDF5 files for every phase (or skip if valid)."""
    index, output, vocab, seed, dupe_factor, phases, compression = job
    import numpy as np

    from bert_trainer.dataset import hdf5, tokens
    from bert_trainer.dataset.instances import Params, blocks, make_pairs, rng_for

    record_path = output / "records" / f"shard_{index:05d}.json"
    params = {"seed": seed, "dupe_factor": dupe_factor, "phases": list(phases),
              "compression": compression, "vocab": sha256(Path(vocab))}
    if _record_ok(record_path, output, params):
        return _with_peak({"shard": index, "skipped": True})
    # Leftovers of an interrupted run of this shard (one worker owns a shard at a time).
    for leftover in output.glob(f"*/.tmp-*shard_{index:05d}.*"):
        leftover.unlink(missing_ok=True)
    specials = specials_of(Path(vocab))
    placement = np.load(output / "text" / "documents.npy", mmap_mode="r")
    own = tokens.load(output / "tokens", index, mapped=False)
    corpus = tokens.Corpus(output / "tokens", placement, index, own)
    numbers = np.flatnonzero(np.asarray(placement[:, 0]) == index)
    record: dict = {"shard": index, "params": params, "files": {}, "phases": {}}
    for phase in phases:
        seq_len, max_pred = PHASES[phase]
        started = time.perf_counter()
        settings = Params(seq_len, max_pred, dupe_factor=dupe_factor, seed=seed)
        rng = rng_for(seed, index, seq_len)
        pairs, pool = make_pairs(corpus, numbers, settings, rng)
        folder = output / f"phase{phase}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"training_shard_{index:05d}.hdf5"
        per_block = hdf5.chunk_rows(seq_len) * max(1, BLOCK_BYTES // (
            hdf5.chunk_rows(seq_len) * seq_len * 8))
        stats = hdf5.write_blocks(path, len(pairs), seq_len, max_pred,
                                  blocks(pairs, pool, settings, specials, rng, per_block),
                                  compression)
        record["files"][f"phase{phase}/{path.name}"] = sha256(path)
        record["phases"][str(phase)] = {
            "instances": len(pairs), "masked_tokens": sum(s.masked_tokens for s in stats),
            "real_tokens": sum(s.real_tokens for s in stats),
            "as_mask": sum(s.masked_as_mask for s in stats),
            "as_random": sum(s.masked_as_random for s in stats),
            "random_next": int(pairs.random_next.sum()), "bytes": path.stat().st_size,
            "seconds": round(time.perf_counter() - started, 3)}
    record_path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_text(record_path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return _with_peak({**record, "instances": sum(p["instances"]
                                                  for p in record["phases"].values())})


def summarize(output: Path, shards: int) -> dict:
    records = [json.loads((output / "records" / f"shard_{i:05d}.json").read_text())
               for i in range(shards)]
    token_records = [json.loads((output / "records" / f"tokens_{i:05d}.json").read_text())
                     for i in range(shards)]
    text = json.loads((output / "text" / "manifest.json").read_text())
    summary = {"documents": text["documents"], "sentences": text["sentences"],
               "text_bytes": text["bytes"], "text_s": text["seconds"], "shards": shards,
               "tokens": sum(r["tokens"] for r in token_records),
               "tokenize_s": round(sum(r["tokenize_s"] for r in token_records), 3),
               "compression": records[0]["params"]["compression"] if records else None,
               "phases": {}}
    for phase in sorted({p for r in records for p in r["phases"]}):
        rows = [r["phases"][phase] for r in records if phase in r["phases"]]
        instances = sum(x["instances"] for x in rows)
        masked = sum(x["masked_tokens"] for x in rows)
        summary["phases"][phase] = {
            "instances": instances,
            "instances_per_shard": [x["instances"] for x in rows],
            "masked_per_instance": round(masked / max(1, instances), 4),
            "masked_fraction": round(masked / max(1, sum(x["real_tokens"] for x in rows)), 4),
            "mask_token_share": round(sum(x["as_mask"] for x in rows) / max(1, masked), 4),
            "random_token_share": round(sum(x["as_random"] for x in rows) / max(1, masked), 4),
            "random_next_fraction": round(sum(x["random_next"] for x in rows)
                                          / max(1, instances), 4),
            "bytes": sum(x["bytes"] for x in rows),
            "seconds": round(sum(x["seconds"] for x in rows), 3)}
    _atomic_text(output / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary


def _wait_for(paths: list[Path], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    for path in paths:
        while not path.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"error: gave up waiting for {what} ({path})")
            time.sleep(0.5)


def _run_stage(name: str, function, jobs: list[tuple], pool, progress_key: str) -> list[dict]:
    progress = Progress(name)
    done: list[dict] = []
    results = pool.imap_unordered(function, jobs) if pool else map(function, jobs)
    for result in results:
        done.append(result)
        progress.tick(shards_done=len(done), shards=len(jobs),
                      **{progress_key: sum(int(r.get(progress_key, 0)) for r in done)})
    return done


def prepare(args: argparse.Namespace) -> int:
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    manifest = output / "text" / "manifest.json"
    if rank == 0 and not manifest.exists():
        made = make_text_shards(args.source, output, args.shards)
        print(json.dumps({"stage": "text", **{k: v for k, v in made.items()
                                              if k not in ("files", "documents.npy")}}),
              flush=True)
    _wait_for([manifest], "the text shards task 0 makes")
    shards = json.loads(manifest.read_text())["shards"]
    mine = [i for i in range(shards) if i % tasks == rank]
    phases = tuple(int(p) for p in args.phases.split(","))
    vocab = str(Path(args.vocab).resolve())
    workers = min(args.workers, max(1, len(mine)))
    if workers > 1:
        # One tokenizer thread per process: the processes are the parallelism.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pool = get_context("fork").Pool(workers) if workers > 1 else None
    try:
        tokenized = _run_stage("tokens", tokenize_shard, [(i, output, vocab) for i in mine],
                               pool, "tokens")
        _wait_for([output / "records" / f"tokens_{i:05d}.json" for i in range(shards)],
                  "every shard's tokens (other tasks make them)")
        jobs = [(i, output, vocab, args.seed, args.dupe_factor, phases, args.compression)
                for i in mine]
        done = _run_stage("instances", instances_shard, jobs, pool, "instances")
    finally:
        if pool:
            pool.close()
            pool.join()
    skipped = sum(1 for d in done if d.get("skipped"))
    print(json.dumps({"stage": "shards", "rank": rank, "done": len(done) - skipped,
                      "skipped": skipped,
                      "tokenized": sum(1 for t in tokenized if not t.get("skipped"))}),
          flush=True)
    # The largest of this task's processes: itself and every worker.
    peak = max([peak_rss_mb(), *(r["peak_rss_mb"] for r in tokenized + done)])
    if rank == 0:
        _wait_for([output / "records" / f"shard_{i:05d}.json" for i in range(shards)],
                  "every shard's instances (other tasks make them)")
        print(json.dumps({"stage": "summary", **summarize(output, shards),
                          "peak_rss_mb": peak}), flush=True)
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def main(argv: list[str] | None = None) -> int:
    from bert_trainer.dataset.hdf5 import COMPRESSIONS

    parser = argparse.ArgumentParser(prog="python -m bert_trainer.dataset",
                                     description="BERT pre-training data preparation")
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser(
        "prepare", help="source -> sharded HDF5 instances (resumable)",
        description="Text -> sentence shards -> tokens -> phase1/ and phase2/ "
                    "training_shard_NNNNN.hdf5 (the legacy BERT format).  Re-run to resume.")
    prep.add_argument("--source", required=True,
                      help="a folder of .txt (.txt.gz, .txt.bz2, .txt.xz) files, one such "
                           "file, or a Wikipedia .xml/.xml.bz2 dump or its URL; a blank line "
                           "ends a document")
    prep.add_argument("--output", required=True)
    prep.add_argument("--vocab", required=True, help="WordPiece vocab.txt")
    prep.add_argument("--shards", type=_positive, default=None,
                      help="text shards (default: about 1 MiB of text each, at least 8 where "
                           f"there are {MIN_DOCUMENTS} documents a shard)")
    prep.add_argument("--seed", type=int, default=12345)
    prep.add_argument("--dupe-factor", type=_positive, default=5)
    prep.add_argument("--phases", default="1,2")
    prep.add_argument("--compression", choices=COMPRESSIONS, default="gzip",
                      help="HDF5 filter of every dataset (default gzip, as the reference)")
    prep.add_argument("--workers", type=_positive,
                      default=max(1, (os.cpu_count() or 2) // 2))
    vocab = commands.add_parser("train-vocab", help="train a WordPiece vocabulary")
    vocab.add_argument("--source", required=True)
    vocab.add_argument("--output", required=True)
    vocab.add_argument("--vocab-size", type=_positive, default=30522)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        if not Path(args.vocab).is_file():
            parser.error(f"--vocab {args.vocab} does not exist (train one: train-vocab)")
        if any(p not in ("1", "2") for p in args.phases.split(",")):
            parser.error(f"--phases {args.phases}: give 1, 2 or 1,2")
        return prepare(args)
    return train_vocab(args)


if __name__ == "__main__":
    sys.exit(main())
