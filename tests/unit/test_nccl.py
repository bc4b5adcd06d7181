"""NCCL validation: the parser and check on logs written for the tests, the transport report,
the plot.  The PyTorch all-reduce benchmark over gloo (torchrun and its ranks) runs in
tests/e2e/test_nccl_gloo.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from imgpipe.recipes.nccl import check, parse
from imgpipe.recipes.ncclinfo import analyze

HEADER = "".join([
    "# nThread 1 nGpus 1 minBytes 8 maxBytes 1073741824 step: 2(factor) warmup iters: 5 "
    "iters: 20 agg iters: 1 validation: 1 graph: 0\n",
    "#\n# Using devices\n{ranks}#\n",
    "#       size         count      type   redop    root     time   algbw   busbw #wrong"
    "     time   algbw   busbw #wrong\n",
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       "
    "     (us)  (GB/s)  (GB/s)\n",
])


def rank_lines(n: int, hosts: int = 1) -> str:
    per_host = n // hosts
    return "".join(f"#  Rank {r:2d} Group  0 Pid  {1000 + r} on node{r // per_host:03d} device "
                   f"{r % per_host:2d} [0x{r:02x}] NVIDIA H100 80GB HBM3\n" for r in range(n))


def row(size: int, time_us: float, factor: float, wrong: str = "0", redop: str = "sum",
        root: int = -1) -> str:
    algbw = size / time_us / 1e3
    busbw = algbw * factor
    cell = f"{time_us:8.1f} {algbw:7.2f} {busbw:7.2f} {wrong:>6}"
    return f" {size:12d} {size // 4:13d}     float {redop:>7} {root:7d} {cell} {cell}\n"


def log(collective: str, ranks: int, rows: list[tuple[int, float]], factor: float,
        hosts: int = 1, oob: int = 0, wrong: str = "0") -> str:
    body = "".join(row(size, t, factor, wrong) for size, t in rows)
    busbws = [size / t / 1e3 * factor for size, t in rows]
    avg = sum(busbws) / len(busbws)
    return (f"# Collective test starting: {collective}_perf\n"
            + HEADER.format(ranks=rank_lines(ranks, hosts)) + body
            + f"# Out of bounds values : {oob} {'OK' if oob == 0 else 'FAILED'}\n"
            + f"# Avg bus bandwidth    : {avg:.5f} \n#\n")


ROWS = [(8, 20.0), (1 << 20, 60.0), (1 << 28, 2000.0), (1 << 29, 3800.0), (1 << 30, 7500.0)]


def test_single_node_numbers() -> None:
    [run] = parse(log("all_reduce", 8, ROWS, 2 * 7 / 8))
    assert (run.collective, run.ranks, len(run.rows)) == ("all_reduce", 8, 5)
    assert run.factor == pytest.approx(1.75)
    assert run.settings["minBytes"] == "8" and run.settings["iters"] == "20"
    last = run.rows[-1]
    assert last.out_of_place.algbw == 143.17 and last.out_of_place.busbw == 250.54
    assert [r.size for r in run.large_rows()] == [1 << 28, 1 << 29, 1 << 30]
    assert run.peak_busbw == 250.54
    assert not any(r.mismatches for r in run.rows)
    [verdict] = check([run], expected_busbw=240)
    assert verdict.status == "pass" and verdict.out_of_bounds == 0


def test_multi_node_srun_prefixed_and_several_collectives() -> None:
    text = log("all_reduce", 16, ROWS, 2 * 15 / 16, hosts=2) + log(
        "all_gather", 16, ROWS, 15 / 16, hosts=2)
    prefixed = "".join(f"{i % 16:>2}: {line}\n" for i, line in enumerate(text.splitlines()))
    runs = parse(prefixed)
    assert [(r.collective, r.ranks) for r in runs] == [("all_reduce", 16), ("all_gather", 16)]
    assert runs[0].factor == pytest.approx(1.875) and runs[1].factor == pytest.approx(0.9375)
    assert runs[0].rows[-1].out_of_place.busbw == 268.44
    assert runs[1].rows[-1].out_of_place.busbw == 134.22
    assert all(not r.mismatches for run in runs for r in run.rows)


def test_printed_values_that_disagree_are_flagged() -> None:
    text = log("all_reduce", 8, ROWS, 2 * 7 / 8).replace(" 250.54", " 300.00", 1)
    [run] = parse(text)
    assert run.rows[-1].mismatches == ["out-of-place busbw printed 300, recomputed 250.540"]
    [verdict] = check([run], expected_busbw=240)
    assert verdict.status == "warn" and verdict.mismatched_rows == 1


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nccl.log"
    path.write_text(text)
    return path


def test_check_cli_pass_low_bandwidth_and_out_of_bounds(cli, tmp_path: Path) -> None:
    good = write(tmp_path, log("all_reduce", 16, ROWS, 2 * 15 / 16, hosts=2))
    code, out, _ = cli("nccl", "check", str(good), "--profile", "dgx-h100", "--nodes", "2",
                       "--json")
    data = json.loads(out)["data"]
    assert code == 0 and data["status"] == "warn"  # 268 GB/s is 75% of dgx-h100's 360
    assert "below 90% of the expected 360 GB/s" in data["runs"][0]["reason"]
    code, _, _ = cli("nccl", "check", str(good), "--profile", "dgx-h100", "--strict")
    assert code == 1
    code, out, _ = cli("nccl", "check", str(good), "--profile", "dgx2", "--nodes", "2")
    assert code == 0 and out.startswith("PASS: all_reduce on 16 rank(s) / 2 node(s)")

    slow = write(tmp_path, log("all_reduce", 16, [(s, t * 8) for s, t in ROWS], 1.875, 2))
    code, out, _ = cli("nccl", "check", str(slow), "--profile", "dgx2")
    assert code == 1 and out.startswith("FAIL:") and "33.55 GB/s is below 70%" in out

    broken = write(tmp_path, log("all_reduce", 16, ROWS, 1.875, hosts=2, oob=3, wrong="3"))
    code, out, _ = cli("nccl", "check", str(broken), "--profile", "dgx2")
    assert code == 1 and "3 out-of-bounds value(s): results are wrong" in out

    na = write(tmp_path, log("all_reduce", 8, ROWS, 1.75, wrong="N/A"))
    [run] = parse(na.read_text())
    assert run.rows[0].out_of_place.wrong is None


def test_check_cli_bad_input(cli, tmp_path: Path) -> None:
    empty = write(tmp_path, "nothing to see\n")
    code, _, err = cli("nccl", "check", str(empty), "--profile", "dgx1")
    assert code == 2 and "holds no nccl-tests results" in err
    code, _, err = cli("nccl", "check", str(tmp_path / "missing.log"), "--profile", "dgx1")
    assert code == 2 and "cannot read" in err


INFO = "node{h:03d}:{pid}:{pid} [{d}] NCCL INFO {msg}\n"


def info_log(via: str) -> str:
    lines = []
    for host in range(2):
        lines.append(INFO.format(h=host, pid=100 + host, d=0,
                                 msg="NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB ; "
                                     "OOB ib0:10.0.0.1<0>"))
        for device in range(2):
            rank = host * 2 + device
            peer = (rank + 2) % 4
            lines.append(INFO.format(h=host, pid=100 + host, d=device,
                                     msg=f"Channel 00/0 : {rank}[{device}] -> {peer}[{device}] "
                                         f"[send] via {via.format(i=device)}"))
            lines.append(INFO.format(h=host, pid=100 + host, d=device,
                                     msg=f"Channel 00 : {rank}[{device}] -> {rank ^ 1}[0] via "
                                         "P2P/IPC"))
    return "".join(lines)


def test_transport_ib_with_gdrdma() -> None:
    report = analyze(info_log("NET/IB/{i}/GDRDMA"))
    assert report.status == "ok"
    assert [(r.rank, r.verdict) for r in report.ranks] == [(i, "ib-gdrdma") for i in range(4)]
    assert [sorted(r.hcas) for r in report.ranks] == [["mlx5_0"], ["mlx5_3"]] * 2


def test_transport_ib_without_gdrdma() -> None:
    report = analyze(info_log("NET/IB/{i}"))
    assert report.status == "warn"
    assert "InfiniBand without GPUDirect RDMA on rank(s) 0, 1, 2, 3" in report.reason


def test_transport_socket_fallback_with_srun_prefix(cli, tmp_path: Path) -> None:
    text = "".join(f"{i}: {line}\n" for i, line in enumerate(
        info_log("NET/Socket/{i}").splitlines()))
    report = analyze(text)
    assert report.status == "warn" and "fell back to sockets" in report.reason
    path = write(tmp_path, log("all_reduce", 4, ROWS, 1.5, hosts=2) + text)
    code, out, _ = cli("nccl", "check", str(path), "--profile", "local", "--json")
    data = json.loads(out)["data"]
    assert code == 0 and data["status"] == "warn"
    assert data["transport"]["ranks"][0]["verdict"] == "socket"
    code, _, _ = cli("nccl", "check", str(path), "--profile", "local", "--strict")
    assert code == 1


def test_plot_is_a_real_png(cli, tmp_path: Path) -> None:
    from PIL import Image

    path = write(tmp_path, log("all_reduce", 8, ROWS, 1.75))
    code, _, err = cli("nccl", "check", str(path), "--profile", "dgx1", "--plot",
                       str(tmp_path / "busbw.png"))
    assert code == 0, err
    with Image.open(tmp_path / "busbw.png") as image:
        assert image.format == "PNG" and image.size == (800, 480)
        assert len(image.convert("L").getcolors(maxcolors=1 << 16)) > 10  # drawn, not blank
        colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    # the warn (90 %) and fail (70 %) lines, and the verdict written in pass green
    assert {(255, 127, 14), (214, 39, 40), (44, 160, 44)} <= colours
