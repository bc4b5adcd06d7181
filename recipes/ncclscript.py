"""The NCCL check as one self-contained Python program, for job scripts.

``nccl.sub`` runs the check on a compute node, where imgpipe is usually not
installed: the program is ``imgpipe.recipes.nccl`` itself (standard library
only) followed by a small main, fed to the image's ``python3`` on stdin.
"""

from __future__ import annotations

from pathlib import Path

from imgpipe.recipes import nccl

MAIN = '''

def _main(argv):
    import sys

    log, nodes = argv[1], int(argv[2])
    try:
        with open(log, errors="replace") as handle:
            text = handle.read()
    except OSError as exc:
        print(f"FAIL: cannot read {log}: {exc.strerror}")
        return 1
    runs = parse(text)
    if not runs:
        print(f"FAIL: {log} holds no nccl-tests results")
        return 1
    verdicts = check(runs, EXPECTED_BUSBW)
    for verdict in verdicts:
        print(verdict_line(verdict, nodes))
        print(f"  out of bounds {verdict.out_of_bounds}, average bus bandwidth "
              f"{verdict.avg_busbw:.2f} GB/s, peak {verdict.peak_busbw:.2f} GB/s, "
              f"expected {verdict.expected_busbw:g} GB/s ({PROFILE})")
    sys.stdout.flush()
    return 1 if any(v.status == "fail" for v in verdicts) else 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv))
'''


def check_program(profile_name: str, expected_busbw: float) -> str:
    """Python source that checks a log: ``python3 - LOG NODES``; exit 1 on a failed run."""
    source = Path(nccl.__file__).read_text()
    constants = f"\nPROFILE = {profile_name!r}\nEXPECTED_BUSBW = {float(expected_busbw)!r}\n"
    program = source + constants + MAIN
    if "\nIMGPIPE_NCCL_CHECK\n" in f"\n{program}\n":
        raise AssertionError("the check program holds its own here-document delimiter")
    return program.rstrip("\n")
