"""Instance creation throughput (MB of text per second per core) against a pure-Python,
token-by-token implementation of the same recipe, measured in one run on one core.

Both sides tokenize with the same WordPiece tokenizer (tokenizers), then build
phase-1 instances (128 tokens, 20 predictions, duplicate factor 5): the
baseline with Python lists and the random module, one token at a time, as the
widely used reference script does; imgpipe with bert_trainer.dataset.instances.

    .venv/bin/python bench/bench_dataset.py [--megabytes 4]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "images" / "bert" / "trainer"))

from bert_trainer.dataset.instances import Params, Specials, build, rng_for  # noqa: E402
from bert_trainer.dataset.prepare import main as dataset_main  # noqa: E402
from bert_trainer.dataset.text import split_sentences  # noqa: E402

from tests.test_dataset import make_corpus  # noqa: E402


def baseline_instances(documents: list[list[list[int]]], params: Params, specials: Specials,
                       rng: random.Random) -> list[dict]:
    """The reference recipe, token by token, in plain Python."""
    limit = params.max_seq_len - 3
    out = []
    for _ in range(params.dupe_factor):
        for index, document in enumerate(documents):
            target = limit if rng.random() >= params.short_seq_prob else rng.randint(2, limit)
            chunk, length, i = [], 0, 0
            while i < len(document):
                chunk.append(document[i])
                length += len(document[i])
                if i == len(document) - 1 or length >= target:
                    a_end = 1 if len(chunk) < 2 else rng.randint(1, len(chunk) - 1)
                    tokens_a = [t for s in chunk[:a_end] for t in s]
                    tokens_b = []
                    random_next = len(documents) > 1 and (len(chunk) == 1 or rng.random() < 0.5)
                    if random_next:
                        other = rng.randint(0, len(documents) - 2)
                        other += other >= index
                        source = documents[other]
                        for sentence in source[rng.randint(0, len(source) - 1):]:
                            tokens_b.extend(sentence)
                            if len(tokens_b) >= target - len(tokens_a):
                                break
                        i -= len(chunk) - a_end
                    else:
                        tokens_b = [t for s in chunk[a_end:] for t in s]
                    while len(tokens_a) + len(tokens_b) > limit:
                        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
                        if rng.random() < 0.5:
                            del longer[0]
                        else:
                            longer.pop()
                    if tokens_a and tokens_b:
                        tokens = [specials.cls, *tokens_a, specials.sep, *tokens_b, specials.sep]
                        segments = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                        candidates = [k for k, t in enumerate(tokens)
                                      if t not in (specials.cls, specials.sep)]
                        rng.shuffle(candidates)
                        count = min(params.max_predictions,
                                    max(1, round(len(candidates) * params.masked_lm_prob)))
                        positions, labels = [], []
                        for k in sorted(candidates[:count]):
                            labels.append(tokens[k])
                            positions.append(k)
                            r = rng.random()
                            if r < 0.8:
                                tokens[k] = specials.mask
                            elif r >= 0.9:
                                tokens[k] = rng.randint(specials.first_normal,
                                                        specials.vocab_size - 1)
                        pad = params.max_seq_len - len(tokens)
                        out.append({"input_ids": tokens + [0] * pad,
                                    "input_mask": [1] * len(tokens) + [0] * pad,
                                    "segment_ids": segments + [0] * pad,
                                    "masked_lm_positions": positions + [0] * (
                                        params.max_predictions - len(positions)),
                                    "masked_lm_ids": labels + [0] * (
                                        params.max_predictions - len(labels)),
                                    "next_sentence_labels": int(random_next)})
                    chunk, length = [], 0
                i += 1
    return out


def run(megabytes: float) -> None:
    from tokenizers import BertWordPieceTokenizer

    with tempfile.TemporaryDirectory(prefix="imgpipe-bench-") as tmp:
        root = Path(tmp)
        files = max(1, int(megabytes * 4))
        source = make_corpus(root / "src", files=files, documents=40)
        size_mb = sum(p.stat().st_size for p in source.glob("*.txt")) / 1e6
        vocab = root / "vocab.txt"
        dataset_main(["train-vocab", "--source", str(source), "--output", str(vocab),
                      "--vocab-size", "2000"])
        tokenizer = BertWordPieceTokenizer(str(vocab), lowercase=True)
        documents = []
        for path in sorted(source.glob("*.txt")):
            for block in path.read_text().split("\n\n"):
                sentences = split_sentences(" ".join(block.split()))
                if sentences:
                    documents.append(sentences)
        ids = {t: tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[UNK]")}
        specials = Specials(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"],
                            tokenizer.get_vocab_size(), max(ids.values()) + 1)
        params = Params(128, 20)

        def tokenized() -> list[list[list[int]]]:
            flat = [s for d in documents for s in d]
            encoded = iter(tokenizer.encode_batch(flat, add_special_tokens=False))
            return [[next(encoded).ids for _ in d] for d in documents]

        started = time.perf_counter()
        base_docs = tokenized()
        tokenize_s = time.perf_counter() - started
        ours_docs = [[np.asarray(s, np.int32) for s in d] for d in tokenized()]

        def best(make) -> tuple[float, object]:
            """Best of three, each after a collection, nothing of a previous run kept alive:
            the baseline's millions of Python objects would otherwise slow whatever runs
            next through the garbage collector."""
            times, result = [], None
            for _ in range(3):
                result = None
                gc.collect()
                started = time.perf_counter()
                result = make()
                times.append(time.perf_counter() - started)
            return min(times), result

        baseline_s, made = best(lambda: baseline_instances(base_docs, params, specials,
                                                           random.Random(12345)))
        made_count = len(made)
        del made
        ours_s, ours = best(lambda: build(ours_docs, params, specials,
                                          rng_for(12345, 0, 128)))
    print(f"\ntext: {size_mb:.1f} MB, {len(documents)} documents; "
          f"instances: baseline {made_count}, imgpipe {ours.input_ids.shape[0]}", file=sys.stderr)
    print(f"tokenizing (the same for both):         {tokenize_s:7.2f} s  "
          f"{size_mb / tokenize_s:6.2f} MB/s/core", file=sys.stderr)
    print("instance creation:", file=sys.stderr)
    print(f"  baseline (pure Python, token by token): {baseline_s:7.2f} s  "
          f"{size_mb / baseline_s:6.2f} MB/s/core", file=sys.stderr)
    print(f"  imgpipe  (token ranges, numpy gathers): {ours_s:7.2f} s  "
          f"{size_mb / ours_s:6.2f} MB/s/core", file=sys.stderr)
    print(f"  ratio: {baseline_s / ours_s:.1f}x", file=sys.stderr)
    print(f"end to end (tokenize + create): baseline {size_mb / (tokenize_s + baseline_s):.2f}"
          f", imgpipe {size_mb / (tokenize_s + ours_s):.2f} MB/s/core, ratio "
          f"{(tokenize_s + baseline_s) / (tokenize_s + ours_s):.1f}x", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=4.0)
    run(parser.parse_args().megabytes)
