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


def test_a_killed_sandbox_does_not_block_the_next_and_a_live_one_is_shared_not_taken_over(
        cli, tmp_path: Path) -> None:
    """A test session killed mid-run leaves namespaces and a bridge but no daemons, and its
    state file in a folder the next run does not know: the next ``up`` of that name clears
    them.  A same-named sandbox that is alive is used by another checkout asking for the same
    shape (and left running by its `down`), refused for another shape."""
    import contextlib
    import json
    import os
    import signal

    first, second = tmp_path / "first", tmp_path / "second"
    args = ("sandbox", "up", "--nodes", "1", "--subnet", "10.213.13", "--name", "imgpk",
            "--cpus", "2")
    cli.write_config({"outputs": {"state_dir": str(first)}})
    try:
        code, out, err = cli(*args)
        assert code == 0, out + err
        cli.write_config({"outputs": {"state_dir": str(second)}})
        # Another checkout asks for the same sandbox: it uses the live one and says so,
        # and its `down` leaves it running.
        code, out, err = cli(*args)
        assert code == 0, out + err
        assert f"started from {first / 'sandbox'}: using it" in out
        assert cli("sandbox", "run", "--host", "node1", "--", "scontrol", "ping")[0] == 0
        code, out, err = cli("sandbox", "down")
        assert code == 0 and "left running" in out, out + err
        # Another shape of the same name is refused, its network left alone.
        code, out, err = cli(*args[:3], "2", *args[4:])
        assert code != 0 and "running already" in err and "1 compute host on" in err, out + err
        cli.write_config({"outputs": {"state_dir": str(first)}})
        assert cli("sandbox", "run", "--", "scontrol", "ping")[0] == 0
        # Kill the first sandbox's daemons the way a killed session does: no teardown.
        state = json.loads((first / "sandbox" / "sandbox.json").read_text())
        for pid in state["pids"].values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        cli.write_config({"outputs": {"state_dir": str(second)}})
        code, out, err = cli(*args)
        assert code == 0, out + err
        assert cli("sandbox", "run", "--host", "node1", "--", "scontrol", "ping")[0] == 0
    finally:
        for state_dir in (second, first):
            cli.write_config({"outputs": {"state_dir": str(state_dir)}})
            cli("sandbox", "down")
