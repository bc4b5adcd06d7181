"""bench/bench_trainer.py's CPU smoke mode: every row and profile it writes has the keys the
GPU table is made from (Hugging Face rows when transformers is installed); its real lengths
carry the published mean, and its length-grouped baseline holds the same sequences."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from bert_trainer.config import BertConfig

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"phase", "impl", "variant", "lengths", "micro_batch", "accumulation",
            "sequences_per_s", "real_tokens_per_s", "mfu", "peak_memory_gib", "step_sd_pct",
            "padded_to", "sample_spread_pct"}


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_trainer",
                                                  ROOT / "bench" / "bench_trainer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_lengths_carry_the_published_mean() -> None:
    module = bench()
    # phase 2: 254 real tokens per 512-token sequence (the generator's own short rows used
    # to stack on the cut: 232)
    arrays = module.make_arrays(BertConfig(), module.SHAPES[2], 2, "real")
    lengths = arrays["input_mask"].sum(1)
    assert len(lengths) == 128 and lengths.mean() == pytest.approx(254, abs=1)
    assert module.length_model(512, 2)[0] == pytest.approx(254, abs=0.1)
    assert (lengths == 512).mean() == pytest.approx(0.2, abs=0.01) and lengths.min() >= 8
    # every cut row still ends in [SEP] and predicts only inside itself
    rows = np.arange(len(lengths))
    assert (arrays["input_ids"][rows, lengths - 1] == 3).all()
    assert (arrays["masked_lm_positions"] < (lengths - 1)[:, None]).all()
    # phase 1: the recipe's rule, one row in ten short: 0.9 x 128 + 0.1 x 68
    phase1 = module.make_arrays(BertConfig(), module.SHAPES[1], 1, "real")
    assert phase1["input_mask"].sum(1).mean() == pytest.approx(122, abs=0.5)


def test_length_grouped_batches_hold_the_same_sequences_each_padded_to_its_longest() -> None:
    module = bench()
    arrays = module.make_arrays(BertConfig(), module.SHAPES[2], 2, "real")
    cpu = torch.device("cpu")
    padded = module.batches_of(arrays, 32, cpu)
    grouped = module.batches_of(arrays, 32, cpu, grouped=True)
    assert {b.input_ids.shape for b in padded} == {(32, 512)}
    widths = [b.input_ids.shape[1] for b in grouped]
    assert widths == sorted(widths, reverse=True) and widths[-1] < 512
    for batch in grouped:
        assert int(batch.input_mask.sum(1).max()) == batch.input_ids.shape[1]

    def sequences(batches: list) -> list[tuple[int, ...]]:
        return sorted(tuple(row[mask.bool()].tolist()) for b in batches
                      for row, mask in zip(b.input_ids, b.input_mask, strict=True))

    assert sequences(grouped) == sequences(padded)
    assert sum(int((b.masked_lm_labels >= 0).sum()) for b in grouped) == sum(
        int((b.masked_lm_labels >= 0).sum()) for b in padded)


@pytest.mark.slow  # about 30-60 s on the 2-core machine: three models, two phases' worth
def test_the_bench_smoke_mode_writes_rows_and_a_profile(tmp_path) -> None:
    out, profile = tmp_path / "rows.json", tmp_path / "profile.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_trainer.py"), "--tiny", "--phases", "2",
         f"--out={out}", f"--profile={profile}", "--steps=1", "--shipped-steps=1",
         "--warmup=1"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    try:
        import transformers  # noqa: F401
        impls = {"imgpipe", "hf-eager", "hf-compiled", "hf-grouped"}
    except ImportError:
        impls = {"imgpipe"}
        assert "transformers is not installed" in result.stdout
    data = json.loads(out.read_text())
    assert {"device", "torch"} <= set(data) and data["device"] == "cpu"
    rows = data["rows"]
    assert {r["impl"] for r in rows} == impls
    assert {(r["lengths"], r["accumulation"]) for r in rows} == {
        (kind, acc) for kind in ("generated", "real") for acc in (1, 4)}
    for row in rows:
        assert ROW_KEYS <= set(row), row
        assert row["sequences_per_s"] > 0 and row["real_tokens_per_s"] > 0
    real = next(r for r in rows if r["lengths"] == "real")
    assert real["mean_real_tokens"] == pytest.approx(64 * 254 / 512, abs=1)
    assert real["sample_spread_pct"] > 0
    assert "real tokens of 64 (the model's mean 31.7;" in result.stdout
    variants = {r["impl"]: r["variant"] for r in rows}
    assert variants["imgpipe"].startswith("unpadded")
    if "hf-grouped" in impls:
        assert variants["hf-compiled"].startswith("padded")
        assert variants["hf-eager"].startswith("padded")
        assert variants["hf-grouped"].startswith("grouped")
        grouped = [r for r in rows if r["impl"] == "hf-grouped"]
        assert all(r["padded_to"] < 64 for r in grouped if r["lengths"] == "real")
        assert all(r["imgpipe_ratio_to_this"] > 0 for r in grouped)
        assert "imgpipe is" in result.stdout and "length-grouped batches" in result.stdout
    profiles = json.loads(profile.read_text())["profiles"]
    assert {p["impl"] for p in profiles} == impls
    for summary in profiles:
        assert set(summary["shares"]) == {"matmul", "elementwise", "optimizer", "attention",
                                          "other"}
        assert abs(sum(s["share"] for s in summary["shares"].values()) - 1) < 0.01
        assert summary["shares"]["matmul"]["share"] > 0
        assert summary["shares"]["optimizer"]["share"] > 0
