"""Dataset preparation per core against the reference recipe, side by side on the same text.

The corpus: English prose from this machine's /usr/share/doc and common-licenses
(bench/corpus.py), at two sizes; one WordPiece vocabulary (30,522 words) trained on it.
The baseline is the reference recipe transcribed to plain Python (tests/reference_recipe.py:
its own tokenizer, one random stream, everything in memory, gzip HDF5), run as users run
the reference script: one process per phase (128/20, then 512/80), each reading imgpipe's
text shards (one sentence a line).  imgpipe runs ``prepare`` whole (sentence splitting,
tokenizing, both phases, writing) on one core too: one worker, the tokenizer's threads off
(``TOKENIZERS_PARALLELISM=false``).

Per core = text megabytes / CPU seconds (user + system of every process of the run): both
sides single-threaded, so that is also their wall time on one core.  Peak RSS: the largest
process (VmHWM).  Size: imgpipe's files against the same instances written in the
reference's format (gzip level 4, h5py's chunks).

    .venv/bin/python bench/bench_dataset.py [--sizes 5,50]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "images" / "bert" / "trainer"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(TRAINER))

from bench.corpus import assemble  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TRAINER}",
       "TOKENIZERS_PARALLELISM": "false"}
PHASES = {1: (128, 20), 2: (512, 80)}

REFERENCE_RUN = """
import json, sys
from pathlib import Path
from tests import reference_recipe
from bert_trainer.dataset.prepare import peak_rss_mb
shards = sorted(Path(sys.argv[1]).glob("shard_*.txt"))
count = reference_recipe.prepare(shards, Path(sys.argv[2]), Path(sys.argv[3]),
                                 int(sys.argv[4]), int(sys.argv[5]))
print(json.dumps({"instances": count, "peak_rss_mb": peak_rss_mb()}))
"""

REFORMAT = """
import sys
from pathlib import Path
import h5py, numpy as np
from tests import reference_recipe
files = sorted(Path(sys.argv[1]).glob("*.hdf5"))
arrays = {k: np.concatenate([h5py.File(f)[k][()] for f in files]) for k in reference_recipe.DTYPES}
reference_recipe.write_hdf5(arrays, Path(sys.argv[2]))
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str]) -> tuple[float, float, str]:
    """(CPU seconds, wall seconds, stdout) of one command and all its processes."""
    cpu, wall = children_cpu(), time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=ENV, check=False)
    if result.returncode:
        raise SystemExit(f"{argv[:4]} failed:\n{result.stderr[-3000:]}")
    return children_cpu() - cpu, time.perf_counter() - wall, result.stdout


def run(sizes: list[float], work: Path) -> None:
    py = sys.executable
    vocab = work / "vocab.txt"
    corpora = {}
    for size in sizes:
        corpora[size] = work / f"corpus-{size:g}MB"
        made = assemble(corpora[size], size)
        print(f"corpus {size:g} MB: {made['bytes'] / 1e6:.1f} MB, "
              f"{made['distinct_bytes'] / 1e6:.1f} MB distinct", file=sys.stderr)
    subprocess.run([py, "-m", "bert_trainer.dataset", "train-vocab", "--source",
                    str(corpora[max(sizes)]), "--output", str(vocab)], env=ENV, check=True,
                   capture_output=True)
    rows = []
    for size in sizes:
        out = work / f"imgpipe-{size:g}"
        cpu, wall, stdout = timed([py, "-m", "bert_trainer.dataset", "prepare", "--source",
                                   str(corpora[size]), "--output", str(out), "--vocab",
                                   str(vocab), "--workers", "1"])
        summary = json.loads(stdout.strip().splitlines()[-1])
        megabytes = summary["text_bytes"] / 1e6
        ref_cpu = ref_wall = 0.0
        ref_peak = 0.0
        ref_instances, ref_bytes, reformatted = {}, 0, 0
        for phase, (seq, pred) in PHASES.items():
            target = work / f"reference-{size:g}-phase{phase}.hdf5"
            c, w, stdout = timed([py, "-c", REFERENCE_RUN, str(out / "text"), str(vocab),
                                  str(target), str(seq), str(pred)])
            made = json.loads(stdout)
            ref_cpu, ref_wall = ref_cpu + c, ref_wall + w
            ref_peak = max(ref_peak, made["peak_rss_mb"])
            ref_instances[str(phase)] = made["instances"]
            ref_bytes += target.stat().st_size
            target.unlink()
            same = work / f"same-{size:g}-{phase}.hdf5"
            subprocess.run([py, "-c", REFORMAT, str(out / f"phase{phase}"), str(same)],
                           env=ENV, check=True)
            reformatted += same.stat().st_size
            same.unlink()
        ours_bytes = sum(p["bytes"] for p in summary["phases"].values())
        rows.append((size, megabytes, cpu, wall, summary, ref_cpu, ref_wall, ref_peak,
                     ref_instances, ref_bytes, reformatted, ours_bytes))
    print("\n| text | reference MB/s/core | imgpipe MB/s/core | ratio | wall ref / imgpipe "
          "| peak RSS ref / imgpipe | instances p1, p2 ref / imgpipe | output ref / imgpipe "
          "/ same instances in ref format |")
    print("|---|---|---|---|---|---|---|---|")
    for (_size, mb, cpu, wall, summary, ref_cpu, ref_wall, ref_peak, ref_inst, ref_bytes,
         reformatted, ours_bytes) in rows:
        ours_inst = [summary["phases"][p]["instances"] for p in ("1", "2")]
        print(f"| {mb:.1f} MB | {mb / ref_cpu:.3f} | {mb / cpu:.2f} | {ref_cpu / cpu:.1f}x "
              f"| {ref_wall:.0f} s / {wall:.1f} s | {ref_peak:.0f} / "
              f"{summary['peak_rss_mb']:.0f} MiB | {ref_inst['1']}, {ref_inst['2']} / "
              f"{ours_inst[0]}, {ours_inst[1]} | {ref_bytes / 1e6:.1f} / {ours_bytes / 1e6:.1f}"
              f" / {reformatted / 1e6:.1f} MB ({ours_bytes / reformatted:.2f}) |")
    print(f"\nimgpipe per stage at {rows[-1][1]:.0f} MB (seconds, summed over workers): "
          f"text {rows[-1][4]['text_s']}, tokens {rows[-1][4]['tokenize_s']}, "
          + ", ".join(f"phase {p} {s['seconds']}" for p, s in rows[-1][4]["phases"].items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5,50", help="corpus sizes in MB, comma-separated")
    sizes = [float(x) for x in parser.parse_args().sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="imgpipe-bench-dataset-") as tmp:
        run(sizes, Path(tmp))
