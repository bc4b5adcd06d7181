"""The image's self-test: a tiny BERT trained a few steps on generated data by the real trainer.

Writes two shards of learnable synthetic instances to a temporary folder, runs
``bert_trainer.pretrain`` on them (LAMB, the schedule, checkpointing, the data
pipeline: everything a real run uses, at a toy size), and passes when the loss
falls clearly.  Prints one JSON line; exits non-zero on failure.  With a GPU it
runs there, in the precision the trainer picks.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    import torch

    from bert_trainer import pretrain
    from bert_trainer.config import TINY
    from bert_trainer.synthetic import write_shards

    steps = int(os.environ.get("BERT_SELFTEST_STEPS", "200"))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bert-selftest-") as work:
        root = Path(work)
        write_shards(root / "phase1", shards=2, per_shard=256, seq_len=32, max_pred=5,
                     vocab_size=TINY.vocab_size)
        (root / "bert_config.json").write_text(TINY.to_json())
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            code = pretrain.main([
                f"--input_dir={root / 'phase1'}", f"--output_dir={root / 'checkpoints'}",
                f"--config_file={root / 'bert_config.json'}", "--max_seq_length=32",
                "--max_predictions_per_seq=5", "--train_batch_size=32",
                "--learning_rate=2e-2", "--warmup_proportion=0.05", f"--max_steps={steps}",
                f"--log_freq={max(1, steps // 6)}", "--no-compile"])
        lines = [json.loads(line) for line in log.getvalue().splitlines()
                 if line.startswith("{")]
        losses = [line["loss"] for line in lines if line["event"] == "step"]
        saved = sorted(p.name for p in (root / "checkpoints" / "phase1").glob("ckpt_*.pt"))
    passed = code == 0 and len(losses) >= 2 and losses[-1] < 0.8 * losses[0] and bool(saved)
    print(json.dumps({"selftest": "passed" if passed else "failed", "torch": torch.__version__,
                      "cuda": torch.cuda.is_available(), "first_loss": losses[0] if losses
                      else None, "final_loss": losses[-1] if losses else None,
                      "steps": steps, "checkpoint": saved[-1] if saved else None,
                      "seconds": round(time.perf_counter() - started, 2)}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
