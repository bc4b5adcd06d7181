"""The PyTorch all-reduce benchmark (bert_trainer.allreduce_bench) over gloo: torchrun
starts its ranks on this host, and `imgpipe nccl check` accepts the nccl-tests table they
print.  The parser and check on logs written for the tests: tests/unit/test_nccl.py."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from imgpipe.recipes.nccl import parse
from tests.unit.test_nccl import write


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("ranks", [3])  # an odd count: the bus bandwidth factor is 4/3
def test_pytorch_benchmark_over_gloo_is_accepted(ranks: int, cli, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), "-m", "bert_trainer.allreduce_bench",
         "-b", "1K", "-e", "1M", "-f", "4", "-n", "5", "-w", "2"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    [run] = parse(result.stdout)
    assert run.ranks == ranks and len(run.rows) == 6
    factor = 2 * (ranks - 1) / ranks
    for r in run.rows:
        for p in (r.out_of_place, r.in_place):
            assert p.wrong == 0
            assert p.busbw == pytest.approx(p.algbw * factor, abs=0.011)
    path = write(tmp_path, result.stdout)
    code, out, err = cli("nccl", "check", str(path), "--profile", "local")
    assert code == 0, out + err
    assert out.startswith(f"PASS: all_reduce on {ranks} rank(s)")
