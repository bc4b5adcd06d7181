"""What an exported model predicts for masked words, as ``transformers``' fill-mask
pipeline gives it (where ``transformers`` is installed: a workstation, the demo's venv).

    python -m bert_trainer.fillmask EXPORT_DIR --corpus TEXT -o fill_mask.json

Takes a few sentences of the corpus, masks one word of each that the vocabulary knows,
and writes ``[{"masked": ..., "word": ..., "predictions": [{"token", "score"}, ...]}]``;
``imgpipe report`` shows them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


def masked_sentences(corpus: Path, vocab: set[str], count: int = 4, words: int = 16
                     ) -> list[tuple[str, str]]:
    """(sentence with one word masked, that word) for the first ``count`` usable lines."""
    found: list[tuple[str, str]] = []
    for line in corpus.read_text(errors="replace").splitlines():
        tokens = re.findall(r"[a-z0-9]+|[^\sa-z0-9]", line.lower())[:words]
        known = [i for i, t in enumerate(tokens) if t in vocab and len(t) > 3]
        if len(tokens) < 6 or not known:
            continue
        at = known[len(known) // 2]
        word, tokens[at] = tokens[at], "[MASK]"
        found.append((" ".join(tokens), word))
        if len(found) == count:
            break
    return found


def predictions(model_dir: Path, corpus: Path, top_k: int = 3) -> list[dict]:
    from transformers import pipeline

    vocab = set((model_dir / "vocab.txt").read_text().split())
    fill = pipeline("fill-mask", model=str(model_dir), device="cpu")
    table = []
    for sentence, word in masked_sentences(corpus, vocab):
        got = fill(sentence, top_k=top_k)
        table.append({"masked": sentence, "word": word,
                      "predictions": [{"token": g["token_str"], "score": round(g["score"], 4)}
                                      for g in got]})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_trainer.fillmask",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, help="a Hugging Face export (--to hf)")
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    if not (args.model_dir / "config.json").is_file():
        print(f"fillmask: {args.model_dir} is not a Hugging Face export (no config.json)",
              file=sys.stderr)
        return 2
    table = predictions(args.model_dir, args.corpus)
    tmp = args.output.with_name(f".{args.output.name}.tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
