"""The trainer's two slow CPU checks (moved out of tests/unit, which must stay fast): the
bench's smoke mode end to end (bench/bench_trainer.py --tiny: every row and profile it writes
has the keys the GPU table is made from, Hugging Face rows when transformers is installed),
and one fused LAMB step (torch.compile of bert_trainer.lamb.lamb_step, inductor's C++ build)
against today's LAMB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bert_trainer.lamb import Lamb

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"phase", "impl", "variant", "lengths", "micro_batch", "accumulation",
            "sequences_per_s", "real_tokens_per_s", "mfu", "peak_memory_gib", "step_sd_pct",
            "padded_to", "sample_spread_pct"}


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


def lamb_pair() -> tuple[list[torch.Tensor], list[torch.Tensor], Lamb, Lamb]:
    """The same weights twice (a matrix, a vector, a zero tensor in each group), and today's
    LAMB and the fused one over them."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(24, 16), (16,), (3, 5, 7), (40,), (8, 8)]
    decay = [0.01, 0.0, 0.01, 0.0, 0.01]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    weights[4].zero_()  # a zero weight: trust ratio 1
    eager = [w.clone().requires_grad_() for w in weights]
    fused = [w.clone().requires_grad_() for w in weights]

    def groups(params: list[torch.Tensor]) -> list[dict]:
        return [{"params": [p for p, d in zip(params, decay, strict=True) if d],
                 "weight_decay": 0.01},
                {"params": [p for p, d in zip(params, decay, strict=True) if not d],
                 "weight_decay": 0.0}]

    return (eager, fused, Lamb(groups(eager), lr=0.05),
            Lamb(groups(fused), lr=0.05, fused=True))


def fused_step_matches_todays() -> None:
    """Five steps of both optimizers, compared (run in a fresh interpreter: see the test)."""
    torch._dynamo.reset()
    eager, fused, one, other = lamb_pair()
    gen = torch.Generator().manual_seed(9)
    for step in range(1, 6):
        for a, b in zip(eager, fused, strict=True):
            # large gradients on odd steps: the global clipping is exercised
            a.grad = torch.randn(a.shape, generator=gen) * (5.0 if step % 2 else 0.05)
            b.grad = a.grad.clone()
        for optimizer in (one, other):
            for group in optimizer.param_groups:
                group["lr"] = 0.05 / step  # as the schedule changes it: no recompilation
        one.step()
        # the first step compiles; a new learning rate or step count must not recompile
        with torch._dynamo.config.patch(error_on_recompile=step > 1):
            other.step()
        torch.testing.assert_close(other.last_grad_norm, one.last_grad_norm, rtol=1e-6,
                                   atol=0)
        for a, b in zip(eager, fused, strict=True):
            torch.testing.assert_close(b.detach(), a.detach(), atol=1e-6, rtol=0)
    assert other.param_groups[0]["step"] == one.param_groups[0]["step"] == 5
    state = other.state_dict()  # saved and restored like today's
    assert state["param_groups"][0]["step"] == 5 and len(state["state"]) == len(fused)


def test_the_fused_lamb_step_gives_todays_update() -> None:
    """In a fresh interpreter: inductor's C++ build imports setuptools, whose distutils shim
    an earlier test of the suite's process can leave unusable (the build then fails on an
    assertion of setuptools' own, before compiling anything)."""
    done = subprocess.run(
        [sys.executable, "-c", "from tests.e2e.test_trainer_slow import "
         "fused_step_matches_todays as check; check()"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
