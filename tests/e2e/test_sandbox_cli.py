"""`imgpipe sandbox`: the tests' multi-host cluster as a user command (root only)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here takes over 20 s


def test_sandbox_up_status_run_down(cli, tmp_path: Path) -> None:
    cli.write_config({"outputs": {"state_dir": str(tmp_path / "state")}})
    try:
        code, out, err = cli("sandbox", "up", "--nodes", "1", "--subnet", "10.213.12",
                             "--name", "imgpc", "--cpus", "2")
        assert code == 0, out + err
        assert "sandbox: up" in out and "node1  10.213.12.11" in out
        code, out, err = cli("sandbox", "status")
        assert code == 0 and "head   10.213.12.1" in out and "idle" in out, out + err
        # Commands run on the cluster's hosts with its slurm.conf, with their exit status.
        assert cli("sandbox", "run", "--", "scontrol", "ping")[0] == 0
        assert cli("sandbox", "run", "--host", "node1", "--", "sh", "-c",
                   "ip -4 -o addr | grep -q ' 10.213.12.11/'")[0] == 0
        code, _, err = cli("sandbox", "run", "--", "sh", "-c", "exit 3")
        assert code == 3 and "exited 3" in err
        code, _, err = cli("sandbox", "run", "--host", "node9", "--", "true")
        assert code == 2 and "node9" in err
    finally:
        code, out, err = cli("sandbox", "down")
    assert code == 0 and "sandbox: down" in out, out + err
    code, out, _ = cli("sandbox", "status")
    assert code == 1 and "sandbox: down" in out
    code, _, err = cli("sandbox", "run", "--", "true")
    assert code == 2 and "not up" in err
    assert not (tmp_path / "state" / "sandbox" / "sandbox.json").exists()
