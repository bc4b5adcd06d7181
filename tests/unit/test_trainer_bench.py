"""bench/bench_trainer.py's CPU smoke mode: every row and profile it writes has the keys the
GPU table is made from (Hugging Face rows when transformers is installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"phase", "impl", "lengths", "micro_batch", "accumulation", "sequences_per_s",
            "real_tokens_per_s", "mfu", "peak_memory_gib"}


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
        impls = {"imgpipe", "hf-eager", "hf-compiled"}
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
    assert real["mean_real_tokens"] < real["seq_len"]
    assert "mean" in result.stdout and "real tokens of 64" in result.stdout
    profiles = json.loads(profile.read_text())["profiles"]
    assert {p["impl"] for p in profiles} == impls
    for summary in profiles:
        assert set(summary["shares"]) == {"matmul", "elementwise", "optimizer", "attention",
                                          "other"}
        assert abs(sum(s["share"] for s in summary["shares"].values()) - 1) < 0.01
        assert summary["shares"]["matmul"]["share"] > 0
        assert summary["shares"]["optimizer"]["share"] > 0
