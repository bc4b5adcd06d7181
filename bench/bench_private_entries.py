"""What a private image costs a second user: the first job on a node of user 2 for an image
user 1 already pulled, when the registry asked for a login (the importer keeps its squashfs
and blobs in user 1's own folder, so user 2 fetches and converts it again) against a public
image (user 2 reads the shared entry user 1's get made), side by side in the same run.

One generated image (bench/ngc_image.py: half random, half patterned files in a few layers)
in one registry storage served by two TLS registries with the same certificate: one open
(public), one asking for a login (private; both users have it in ~/.netrc).  Each row on a
fresh shared cache (`imgpipe node-config --make-cache`): user 1's `get`, then bob's (user 2),
each through `runuser` and the system-Python imgpipe: "public" (the baseline) has root's `get`
make the shared entry, as an admin (or the cache writer) does; "public-by-user" has alice's,
an entry of her own name (`.u<uid>`) that bob does not run; "private" has alice's, kept in her
own folder.  Bytes are the registry's own access log (GET answers, blobs and manifests) during
bob's `get`.  Rows rotate, repeated.  As root:

    .venv/bin/python bench/bench_private_entries.py [--size 384M --layers 6 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import trustme  # noqa: E402
from ngc_image import generate  # noqa: E402

from imgpipe.base.units import human_bytes, parse_size  # noqa: E402
from tests import services  # noqa: E402
from tests.cluster import USERS, ensure_users, remove_folder, shared_folder, system_imgpipe  # noqa: E402

LOGIN, PASSWORD = "puller", "Pr1vate-pa55"
REPO = "bench/private"
SERVED = re.compile(r'"GET /v2/[^ ]+ HTTP/[0-9.]+" 20[06] ([0-9]+)')
OUT = ROOT / "bench" / "results" / "private-entries.json"


def registries(folder: Path, data: Path) -> dict[str, services.RegistryProcess]:
    """The public and the private registry, TLS both, on the one storage in ``data``."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(folder / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(folder / "server.crt"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    (folder / "ca.pem").chmod(0o644)
    services.htpasswd_file(folder / "htpasswd", LOGIN, PASSWORD)
    tls = {"tls": {"certificate": str(folder / "server.crt"), "key": str(folder / "server.key")}}
    storage = {"filesystem": {"rootdirectory": str(data)}}
    auth = {"auth": {"htpasswd": {"realm": "private", "path": str(folder / "htpasswd")}}}
    return {row: services.start_registry(folder / row, scheme="https", extra={
        "http": dict(tls), "storage": storage, **(auth if row == "private" else {})})
        for row in ("public", "private")}


def site_config(folder: Path, server: services.RegistryProcess, cache: Path) -> Path:
    path = folder / f"{server.root.name}.yaml"
    registry = {"host": "127.0.0.1", "port": server.port, "scheme": "https",
                "ca_file": str(folder / "ca.pem")}
    if server.root.name == "private":
        registry["credentials"] = {"source": "netrc"}
    path.write_text(json.dumps({"registry": registry, "outputs": {"squashfs_dir": str(cache)}}))
    path.chmod(0o644)
    return path


def fresh_cache(cache: Path) -> None:
    remove_folder(cache)
    made = subprocess.run([str(ROOT / ".venv" / "bin" / "imgpipe"), "node-config",
                           "--make-cache", str(cache)], capture_output=True, text=True,
                          timeout=60)
    if made.returncode != 0:
        raise SystemExit(f"node-config --make-cache: {made.stderr.strip()}")


def first_get(importer: Path, user: str, config: Path, uri: str,
              log: Path) -> dict[str, object]:
    """Seconds and registry bytes of ``user``'s `get`, and where its squashfs lies."""
    since = log.stat().st_size
    started = time.perf_counter()
    done = subprocess.run(["runuser", "-u", user, "--", "env", f"IMGPIPE_CONFIG={config}",
                           f"HOME={pwd.getpwnam(user).pw_dir}", str(importer), "get", uri],
                          capture_output=True, text=True, timeout=1800, cwd="/tmp")
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"get as {user} ({config.stem}) exited {done.returncode}:\n"
                         f"{done.stderr.strip()}")
    time.sleep(1)  # the registry logs a request once its client has the bytes
    text = log.read_bytes()[since:].decode(errors="replace")
    return {"seconds": round(took, 2), "bytes": sum(int(n) for n in SERVED.findall(text)),
            "path": done.stdout.strip()}


def write_netrc(user: str, keep: dict[Path, bytes | None]) -> None:
    entry = pwd.getpwnam(user)
    netrc = Path(entry.pw_dir) / ".netrc"
    keep[netrc] = netrc.read_bytes() if netrc.exists() else None
    netrc.write_text(f"machine 127.0.0.1 login {LOGIN} password {PASSWORD}\n")
    os.chown(netrc, entry.pw_uid, entry.pw_gid)
    netrc.chmod(0o600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="384M", help="the image's unpacked size")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ensure_users()
    first, second = USERS
    importer = system_imgpipe(ROOT) / "imgpipe-pyxis-importer"
    folder = shared_folder("bench-private-")
    cache = folder / "squashfs"
    servers: dict[str, services.RegistryProcess] = {}
    netrcs: dict[Path, bytes | None] = {}
    rows: dict[str, list[dict]] = {"public": [], "public-by-user": [], "private": []}
    try:
        maker = services.start_registry(folder / "maker")  # plain HTTP: ngc_image pushes
        try:
            image = generate(maker.address, REPO, "v1", parse_size(args.size), args.layers,
                             2026, folder / "ngc-state.json", say=lambda text: None)
        finally:
            maker.stop()
        print(f"image: {human_bytes(image['unpacked'])} unpacked, "
              f"{human_bytes(image['compressed'])} of gzip blobs, {image['layers']} layers, "
              f"{image['files']} files", flush=True)
        servers = registries(folder, maker.data)
        for user in USERS:
            write_netrc(user, netrcs)
        for number in range(args.rounds):
            order = list(rows)[number % 3:] + list(rows)[:number % 3]
            for row in order if number % 2 == 0 else order[::-1]:
                server = servers["private" if row == "private" else "public"]
                config = site_config(folder, server, cache)
                uri = f"docker://127.0.0.1:{server.port}#{REPO}@{image['digest']}"
                fresh_cache(cache)
                log = server.root / "registry.log"
                one = first_get(importer, "root" if row == "public" else first, config, uri,
                                log)
                two = first_get(importer, second, config, uri, log)
                shared = two["path"] == one["path"]
                rows[row].append({"user1": one, "user2": two, "user2_runs_user1s_entry": shared})
                print(f"  round {number + 1} {row:14} user 1 {one['seconds']:6.2f} s "
                      f"{human_bytes(int(one['bytes'])):>10}   user 2 {two['seconds']:6.2f} s "
                      f"{human_bytes(int(two['bytes'])):>10}   user 2's squashfs "
                      f"{'user 1s' if shared else 'its own'}: {two['path']}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        for netrc, before in netrcs.items():
            if before is None:
                netrc.unlink(missing_ok=True)
            else:
                netrc.write_bytes(before)
        remove_folder(folder)
    report(image, rows)


def report(image: dict, rows: dict[str, list[dict]]) -> None:
    summary = {row: {"user1_seconds": statistics.median(r["user1"]["seconds"] for r in runs),
                     "user2_seconds": statistics.median(r["user2"]["seconds"] for r in runs),
                     "user2_bytes": statistics.median(r["user2"]["bytes"] for r in runs)}
               for row, runs in rows.items()}
    pub, priv = summary["public"], summary["private"]
    ratio = priv["user2_seconds"] / pub["user2_seconds"]
    print(f"\nmedian of {len(rows['public'])}, alternating:")
    print("| image | user 1's first get | user 2's first get | registry bytes for user 2 |")
    print("|---|---|---|---|")
    for row, s in summary.items():
        times = ", ".join(f"{r['user2']['seconds']:.2f}" for r in rows[row])
        print(f"| {row} | {s['user1_seconds']:.2f} s | {s['user2_seconds']:.2f} s ({times}) | "
              f"{human_bytes(int(s['user2_bytes']))} |")
    print(f"ratio private/public, user 2's time: {ratio:.1f}; bytes: "
          f"{int(priv['user2_bytes'])} / {int(pub['user2_bytes'])}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"image": {k: image[k] for k in ("digest", "layers", "files",
                                                                "unpacked", "compressed")},
                               "runs": rows, "median": summary,
                               "ratio_user2_seconds": round(ratio, 2)}, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
