"""What bench/bench_fanout.py reads from a job without a cluster: the importer wrapper's CPU
line (bash's ``times`` around a real program), the broadcast's line of stage times turned
into seconds since the job's start, and the machine's CPU time from /proc/stat."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from imgpipe.enroot.published.relay import NodeTimes, stages_line
from tests.bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("bench_fanout")


def test_the_wrapper_says_the_cpu_time_of_the_importer_and_its_children(
        bench: ModuleType, tmp_path: Path) -> None:
    importer = tmp_path / "importer"
    importer.write_text("#!/bin/sh\n"  # a child that burns some CPU, the exit status kept
                        "sh -c 'i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done'\n"
                        'echo "$1 done"\nexit 3\n')
    importer.chmod(0o755)
    done = subprocess.run([str(bench.timed_importer(tmp_path, str(importer))), "take", "x"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and done.stdout == "take done\n"
    [line] = done.stderr.splitlines()
    assert line.startswith("cpu-task ") and " take " in line
    assert 0 < bench.task_cpu_s(f"start 1.0\n{line}\n{line}\n") < 60
    assert bench.task_cpu_s("cpu-task node1 take 62.500 0.250\n"
                            "cpu-task node2 broadcast 1.000 0.500\n") == 64.25


def test_the_stage_line_becomes_seconds_since_the_jobs_start(bench: ModuleType) -> None:
    begun = 5000.0  # the batch host's task began its fetch 1.5 s after the job's start
    nodes = [NodeTimes(ready=5001.0, first=5003.0 + 0.1 * i, last=5020.0 + 0.1 * i,
                       checked=5020.4 + 0.1 * i) for i in range(3)]
    line = stages_line(begun, {"ready": 5001.2, "first_chunk": 5002.5, "fetch": 5019.0,
                               "gathered": 5021.0}, nodes)
    text = f"start 4998.5\nimgpipe: node1: {line}\nfirst node1 5021.3\n"
    stages = bench.stage_times(text, 4998.5)
    assert stages["batch_fetch_start"] == 1.5 and stages["mpi_ready"] == 2.7
    assert stages["batch_first_chunk"] == 4.0 and stages["batch_fetch_done"] == 20.5
    assert stages["batch_fetch_s"] == 19.0 and stages["first_byte_last_node"] == 4.7
    assert stages["last_unit"] == 21.7 and stages["final_check"] == 22.1
    assert stages["gathered"] == 22.5 and stages["per_hop_s"] == 0.1 and stages["nodes"] == 3
    assert "first byte at the last node 4.7" in bench.stages_text(stages)
    assert bench.stage_times("start 1.0\nno stages here\n", 1.0) is None


def test_the_machines_cpu_time_is_counted_from_proc_stat(bench: ModuleType) -> None:
    before = bench.machine_cpu()
    assert len(before) == 8
    spent = bench.machine_cpu_since([max(0, x - 100) for x in before])
    assert 0 <= spent["machine_busy"] <= 1 and spent["cores"] >= 1
    assert spent["machine_cpu_s"] >= 0 and spent["machine_iowait_s"] >= 0
