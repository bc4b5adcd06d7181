"""The small numerics the last checkpoint review left (issue 62), through the trainer's and the
export's own entry points: a one-segment config on two-segment data, a vocabulary without
[SEP], a resume that raises --max_steps or changes the global batch, an export under a
private umask."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest
from bert_trainer import checkpoint
from bert_trainer.config import TINY
from bert_trainer.export import main as export_main
from bert_trainer.modelcard import training_table
from bert_trainer.pretrain import main as pretrain_main
from bert_trainer.schedule import poly_warmup_factor
from bert_trainer.synthetic import write_shards

from tests.trainer_signals import handlers_kept

SEQ, PRED, RATE, WARMUP = 32, 5, 1e-3, 0.5
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(TINY.vocab_size
                                                                                   - 5)]


def pretrain(data: Path, config: Path, output: Path, *extra: str) -> int:
    with handlers_kept():
        return pretrain_main([f"--input_dir={data}", f"--output_dir={output}",
                              f"--config_file={config}", f"--max_seq_length={SEQ}",
                              f"--max_predictions_per_seq={PRED}", f"--learning_rate={RATE}",
                              f"--warmup_proportion={WARMUP}", "--log_freq=1", *extra])


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("shards") / "phase1"
    write_shards(folder, shards=2, per_shard=32, seq_len=SEQ, max_pred=PRED,
                 vocab_size=TINY.vocab_size)
    return folder


@pytest.fixture(scope="module")
def resumed_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 steps of 4 sequences, then resumed to 4 steps of 8: the run's folder."""
    root = tmp_path_factory.mktemp("run")
    config = root / "bert_config.json"
    config.write_text(TINY.to_json())
    assert pretrain(data, config, root / "ckpt", "--max_steps=2", "--train_batch_size=4") == 0
    assert pretrain(data, config, root / "ckpt", "--max_steps=4", "--train_batch_size=8",
                    "--resume_from_checkpoint", f"--results_dir={root / 'results'}") == 0
    return root


def test_a_one_segment_config_on_two_segment_data_is_one_line(
        data: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "one-segment.json"
    config.write_text(dataclasses.replace(TINY, type_vocab_size=1).to_json())
    assert pretrain(data, config, tmp_path / "ckpt", "--max_steps=1",
                    "--train_batch_size=4") == 1
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {data}/shard_")
    assert "segment id 1 is outside the model's type_vocab_size of 1" in err
    assert "check --config_file" in err and "type_vocab_size is 2" in err


def test_a_vocabulary_without_sep_is_one_line_naming_it(
        resumed_run: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(w if w != "[SEP]" else "[SEPARATOR]" for w in WORDS) + "\n")
    capfd.readouterr()
    assert export_main([str(resumed_run / "ckpt"), "--to", "hf", "-o", str(tmp_path / "out"),
                        f"--vocab_file={vocab}"]) == 2
    assert capfd.readouterr().err == (
        f"export: {vocab} lacks BERT's [SEP] token: pass the vocabulary the data was made "
        "with (--vocab_file)\n")
    assert list(tmp_path.iterdir()) == [vocab]  # nothing half-written beside it


def test_raising_max_steps_on_resume_takes_the_new_schedule_from_the_first_step(
        resumed_run: Path) -> None:
    lines = (resumed_run / "results" / "bert_phase1.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"event": "step"' in line]
    assert [s["step"] for s in steps] == [3, 4]
    # the old schedule (2 steps) would give step 3 the rate of a finished schedule: 0.0
    assert steps[0]["learning_rate"] == pytest.approx(RATE * poly_warmup_factor(3, 4, WARMUP))
    assert steps[0]["learning_rate"] == pytest.approx(7.071e-4, rel=1e-3)
    assert steps[1]["learning_rate"] == 0.0  # the last step of the new schedule


def test_the_lineage_keeps_the_batch_each_run_of_steps_had(resumed_run: Path) -> None:
    payload = checkpoint.load(resumed_run / "ckpt" / "phase1" / "ckpt_4.pt")
    record = payload["lineage"][-1]
    assert record["step"] == 4 and record["global_batch"] is None
    assert record["batches"] == [{"from_step": 1, "global_batch": 4},
                                 {"from_step": 3, "global_batch": 8}]
    row = training_table(payload["lineage"])[-1]
    assert "| 4 (steps 1-2), 8 (steps 3-4) | 4 |" in row


def test_the_lineage_of_a_resume_at_the_same_batch_stays_one_number() -> None:
    from bert_trainer.lineage import finished, resumed

    record = {"phase": 1, "global_batch": 8, "max_steps": 10}
    same = resumed(record, {"phase": 1, "global_batch": 8, "step": 4}, 4)
    assert same == record and finished(same, 10, 2.5)["global_batch"] == 8
    # resumed at another batch, then stopped before a step ran at it: nothing to split
    changed = resumed(record, {"phase": 1, "global_batch": 4, "step": 4}, 4)
    assert changed["global_batch"] is None and len(changed["batches"]) == 2
    kept = finished(changed, 4, 3.0)
    assert kept["global_batch"] == 4 and "batches" not in kept
    # a checkpoint from before lineage: the earlier batch is not known, and says so
    unknown = finished(resumed(record, None, 4), 6, 2.0)
    assert unknown["batches"] == [{"from_step": 1, "global_batch": None},
                                  {"from_step": 5, "global_batch": 8}]


@pytest.mark.parametrize(("umask", "folder_mode", "file_mode"),
                         [(0o077, 0o700, 0o600), (0o022, 0o755, 0o644)])
def test_an_export_keeps_the_umask(resumed_run: Path, tmp_path: Path, umask: int,
                                   folder_mode: int, file_mode: int) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(WORDS) + "\n")
    old = os.umask(umask)
    try:
        assert export_main([str(resumed_run / "ckpt"), "--to", "hf", "-o",
                            str(tmp_path / "bert"), f"--vocab_file={vocab}"]) == 0
    finally:
        os.umask(old)
    folder = tmp_path / "bert"
    assert stat.S_IMODE(folder.stat().st_mode) == folder_mode
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
    assert modes == dict.fromkeys(["config.json", "model.safetensors", "vocab.txt",
                                   "tokenizer.json", "tokenizer_config.json",
                                   "imgpipe_export.json", "README.md"], file_mode)
