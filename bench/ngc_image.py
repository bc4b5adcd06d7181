"""A deterministic NGC-scale image, pushed straight to a registry's HTTP API (no engine).

NVIDIA's PyTorch images are 15-20 GB unpacked in 40+ layers with 300,000+ files, a few
single files over 2 GiB, and whiteouts between layers.  No such image can be pulled here,
so this makes one of that shape from a seed: the same bytes, digests and manifest on every
run, whatever the machine.

- a base layer of many small files (``.py`` sources and their ``.pyc``-like twins), with
  symbolic links and hard links;
- "pip install" layers: small files plus shared libraries of 10-500 MB (half random, half
  patterned: gzip halves them, as it does real ones);
- two files of 15 % of the size each (over 2 GiB at 15 GB), in layers of their own;
- a layer that replaces a large library of a lower one, a layer of whiteouts (files of
  lower layers deleted) and an opaque directory (a lower folder's content hidden, new put in).

Each layer is generated, tarred, gzipped and hashed as a stream and sent in chunks to the
registry's upload API (no temporary copy); a state file keeps each layer's digests, so a
run killed half-way sends only the layers the registry does not hold yet (HEAD first).

    .venv/bin/python bench/ngc_image.py --registry 127.0.0.1:5000 --size 15G
    .venv/bin/python bench/ngc_image.py --registry 127.0.0.1:5000 --size 5G --layers 40
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import io
import json
import os
import random
import struct
import sys
import tarfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from imgpipe.base.units import human_bytes, parse_size  # noqa: E402

CHUNK = 32 << 20  # bytes per PATCH
BLOCK = 64 << 10  # content is made in blocks: half random, half a repeated pattern
SMALL_FILE_MEAN = 6 << 10
FILES_PER_GB = 21_000
PLAN_VERSION = 3  # bump when plan() changes: a resumed run must not mix old layers in
LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_V1 = "application/vnd.docker.container.image.v1+json"
EPOCH = int(dt.datetime(2026, 1, 1, tzinfo=dt.UTC).timestamp())


@dataclass
class Entry:
    """One member of a layer: a file of ``size`` bytes made from ``seed``, a link, a
    folder, or a whiteout (an empty file named ``.wh.NAME`` or ``.wh..wh..opq``)."""

    path: str
    kind: str = "file"  # file | program | copy | dir | symlink | hardlink | whiteout
    size: int = 0
    seed: int = 0
    target: str = ""


@dataclass
class Layer:
    name: str
    entries: list[Entry] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)


class Content(io.RawIOBase):
    """``size`` deterministic bytes from ``seed``, read once in order, as tarfile does:
    64 KiB blocks, each half fresh random bytes (from the file's own generator) and half a
    pattern, so zstd and gzip shrink it about as much as real libraries and weights."""

    def __init__(self, seed: int, size: int, random_share: float = 0.5) -> None:
        self.size, self.offset = size, 0
        self.rng = random.Random(seed)
        self.noise = int(BLOCK * random_share)
        self.pattern = (f"{seed:016x} imgpipe scale bench ".encode() * (BLOCK // 16))[
            :BLOCK - self.noise]
        self.buffer = b""

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        left = self.size - self.offset
        n = left if n < 0 else min(n, left)
        while len(self.buffer) < n:
            self.buffer += self.rng.randbytes(self.noise) + self.pattern
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        self.offset += n
        return out


def source_text(seed: int, size: int) -> bytes:
    """A small Python-like source file (compressible, as real ones are)."""
    line = f"def f_{seed}(x):\n    return x * {seed % 97} + {seed % 13}  # imgpipe\n".encode()
    return (line * (size // len(line) + 1))[:size]


def plan(total: int, layers: int, seed: int) -> list[Layer]:
    """What goes where: the same plan for the same size, layer count and seed."""
    if layers < 6:
        raise SystemExit("error: --layers must be at least 6 (base, big files, replace, "
                         "whiteouts)")
    rng = random.Random(seed)
    files = max(200, int(total / 1e9 * FILES_PER_GB))
    big = int(total * 0.15)
    small_budget = files * SMALL_FILE_MEAN
    lib_budget = max(0, total - 2 * big - small_budget)
    plain = layers - 5  # base, two big files, the replacement, the whiteouts are fixed
    made: list[Layer] = []
    base = Layer("base")
    for i in range(files // (plain + 1)):
        pkg = f"usr/lib/python3/dist-packages/pkg{i // 200:04d}"
        size = max(64, int(rng.expovariate(1 / SMALL_FILE_MEAN)))
        base.entries.append(Entry(f"{pkg}/mod{i:06d}.py", size=size, seed=rng.getrandbits(32)))
    base.entries += [Entry("usr/bin/python3.10", size=5 << 20, seed=rng.getrandbits(32)),
                     Entry("usr/bin/python3", "symlink", target="python3.10"),
                     Entry("usr/bin/python", "symlink", target="python3"),
                     Entry("usr/bin/python3.10-config", "hardlink", target="usr/bin/python3.10"),
                     Entry("usr/bin/true", "program"),
                     # what a real base image has and container runtimes mount over
                     *[Entry(folder, "dir") for folder in ("dev", "proc", "sys", "tmp", "run",
                                                           "home", "mnt", "root", "var/tmp",
                                                           "workspace")],
                     *[Entry(f"etc/{name}", size=64, seed=index) for index, name in
                       enumerate(("passwd", "group", "hosts", "resolv.conf"))],
                     Entry("opt/legacy/README", size=4096, seed=1),
                     Entry("opt/legacy/plugin.so", size=1 << 20, seed=2)]
    made.append(base)
    for index in range(plain):
        layer = Layer(f"pip-{index:02d}")
        site = f"usr/local/lib/python3.10/dist-packages/lib{index:02d}"
        for i in range(files // (plain + 1)):
            size = max(64, int(rng.expovariate(1 / SMALL_FILE_MEAN)))
            suffix = ".py" if i % 2 == 0 else ".pyc"
            layer.entries.append(Entry(f"{site}/sub{i // 500:03d}/m{i:06d}{suffix}", size=size,
                                       seed=rng.getrandbits(32)))
        share = lib_budget // plain
        part = 0
        while share > 0:
            size = min(share, rng.randint(10 << 20, 500 << 20))
            layer.entries.append(Entry(f"{site}/_native{part}.so", size=size,
                                       seed=rng.getrandbits(32)))
            share -= size
            part += 1
        made.append(layer)
    made.insert(2, Layer("big-a", [Entry("opt/weights/a.bin", size=big, seed=11)]))
    made.insert(4, Layer("big-b", [Entry("opt/weights/b.bin", size=big, seed=12)]))
    replaced = next(e for e in made[1].entries if e.path.endswith(".so"))
    made.append(Layer("replace", [Entry(replaced.path, size=replaced.size,
                                        seed=replaced.seed + 1)]))
    victims = [e.path for e in made[1].entries if e.path.endswith(".py")][:50]
    made.append(Layer("whiteouts", [
        *[Entry(_whiteout(p), "whiteout") for p in victims],
        Entry("opt/legacy/.wh..wh..opq", "whiteout"),
        Entry("opt/legacy/NEW", size=4096, seed=3)]))
    return made


def _whiteout(path: str) -> str:
    folder, _, name = path.rpartition("/")
    return f"{folder}/.wh.{name}"


class Upload:
    """A file object that gzips, hashes and sends what tarfile writes, in chunks."""

    def __init__(self, session: requests.Session, url: str, repo: str) -> None:
        self.session, self.url = session, url
        start = session.post(f"{url}/v2/{repo}/blobs/uploads/", timeout=60)
        if start.status_code != 202:
            raise SystemExit(f"error: {repo}: upload refused: HTTP {start.status_code}")
        self.location = self._absolute(start.headers["Location"])
        self.gzip = zlib.compressobj(1, zlib.DEFLATED, 31)  # gzip, fastest level
        self.diff_id, self.digest = hashlib.sha256(), hashlib.sha256()
        self.pending = bytearray()
        self.sent = 0
        self.raw = 0

    def _absolute(self, location: str) -> str:
        return self.url + location if location.startswith("/") else location

    def write(self, data: bytes) -> int:
        self.diff_id.update(data)
        self.raw += len(data)
        self._queue(self.gzip.compress(data))
        return len(data)

    def _queue(self, data: bytes) -> None:
        self.digest.update(data)
        self.pending += data
        if len(self.pending) >= CHUNK:
            self._patch()

    def _patch(self) -> None:
        body = bytes(self.pending)
        reply = self.session.patch(self.location, data=body, timeout=300, headers={
            "Content-Type": "application/octet-stream",
            "Content-Range": f"{self.sent}-{self.sent + len(body) - 1}"})
        if reply.status_code != 202:
            raise SystemExit(f"error: upload chunk refused: HTTP {reply.status_code} {reply.text}")
        self.location = self._absolute(reply.headers["Location"])
        self.sent += len(body)
        self.pending.clear()

    def finish(self) -> tuple[str, str, int]:
        """(digest, diff_id, compressed size) once the registry has the whole blob."""
        self._queue(self.gzip.flush())
        if self.pending:
            self._patch()
        digest = "sha256:" + self.digest.hexdigest()
        sep = "&" if "?" in self.location else "?"
        done = self.session.put(f"{self.location}{sep}digest={digest}", timeout=300)
        if done.status_code != 201:
            raise SystemExit(f"error: upload not accepted: HTTP {done.status_code} {done.text}")
        return digest, "sha256:" + self.diff_id.hexdigest(), self.sent


def exit_zero_program() -> bytes:
    """A static x86-64 Linux program that exits 0 (one ELF header, one loadable segment,
    nine bytes of code): what a task runs in the image to show it started."""
    code = bytes([0x31, 0xFF,  # xor edi, edi
                  0xB8, 0x3C, 0, 0, 0,  # mov eax, 60 (exit)
                  0x0F, 0x05])  # syscall
    load, headers = 0x400000, 64 + 56
    size = headers + len(code)
    elf = struct.pack("<4sBBBBB7xHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, 2, 0x3E, 1,
                      load + headers, 64, 0, 0, 64, 56, 1, 0, 0, 0)
    segment = struct.pack("<IIQQQQQQ", 1, 5, 0, load, load, size, size, 0x1000)
    return elf + segment + code


def members(layer: Layer) -> Iterator[tuple[tarfile.TarInfo, io.RawIOBase | None]]:
    folders: set[str] = set()
    for entry in layer.entries:
        parts = entry.path.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            folder = "/".join(parts[:depth])
            if folder not in folders:
                folders.add(folder)
                info = tarfile.TarInfo(folder)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
                yield info, None
        info = tarfile.TarInfo(entry.path)
        if entry.kind == "dir":
            if entry.path not in folders:
                folders.add(entry.path)
                info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
                yield info, None
            continue
        info.mtime, info.mode = EPOCH, 0o755 if entry.path.endswith((".so", "3.10")) else 0o644
        if entry.kind == "file":
            info.size = entry.size
            small = entry.size < (1 << 20)
            yield info, (io.BytesIO(source_text(entry.seed, entry.size)) if small
                         else Content(entry.seed, entry.size))
        elif entry.kind == "copy":  # this host's file ``target``
            code = Path(entry.target).read_bytes()
            info.size, info.mode = len(code), 0o755
            yield info, io.BytesIO(code)
        elif entry.kind == "program":
            code = exit_zero_program()
            info.size, info.mode = len(code), 0o755
            yield info, io.BytesIO(code)
        elif entry.kind in ("symlink", "hardlink"):
            info.type = tarfile.SYMTYPE if entry.kind == "symlink" else tarfile.LNKTYPE
            info.linkname = entry.target
            yield info, None
        else:
            yield info, io.BytesIO(b"")


def push_layer(session: requests.Session, url: str, repo: str, layer: Layer
               ) -> tuple[str, str, int]:
    upload = Upload(session, url, repo)
    with tarfile.open(fileobj=upload, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
        for info, data in members(layer):
            tar.addfile(info, data)
    return upload.finish()


def exists(session: requests.Session, url: str, repo: str, digest: str) -> bool:
    return session.head(f"{url}/v2/{repo}/blobs/{digest}", timeout=60).status_code == 200


def put_blob(session: requests.Session, url: str, repo: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    start = session.post(f"{url}/v2/{repo}/blobs/uploads/", timeout=60)
    location = start.headers["Location"]
    location = url + location if location.startswith("/") else location
    sep = "&" if "?" in location else "?"
    done = session.put(f"{location}{sep}digest={digest}", data=data, timeout=60,
                       headers={"Content-Type": "application/octet-stream"})
    if done.status_code != 201:
        raise SystemExit(f"error: config not accepted: HTTP {done.status_code}")
    return digest


def host_shell() -> Layer:
    """A layer with this host's /bin/sh (dash) and the libraries it loads: what Enroot needs
    to start a container (it runs ``/etc/rc`` with /bin/sh).  Not reproducible across hosts,
    so only added on request (``bench_start.py --pyxis``)."""
    return Layer("host-shell", [Entry("bin/sh", "copy", target=os.path.realpath("/bin/sh")),
                                *[Entry(path.lstrip("/"), "copy", target=os.path.realpath(path))
                                  for path in ("/lib/x86_64-linux-gnu/libc.so.6",
                                               "/lib64/ld-linux-x86-64.so.2")]])


def generate(registry: str, repo: str, tag: str, total: int, layers: int, seed: int,
             state_file: Path, say: object = print, extra: list[Layer] | None = None
             ) -> dict[str, object]:
    """Push the image (and ``extra`` layers on top); its manifest digest, sizes and counts,
    and seconds spent."""
    url = f"http://{registry}"
    session = requests.Session()
    session.trust_env = False
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {}
    key = "-".join([str(total), str(layers), str(seed), f"v{PLAN_VERSION}",
                    *[layer.name for layer in extra or []]])
    done_layers: dict[str, list] = state.get(key, {})
    started = time.monotonic()
    descriptors, diff_ids, history = [], [], []
    layer_plan = plan(total, layers, seed) + list(extra or [])
    for number, layer in enumerate(layer_plan):
        known = done_layers.get(layer.name)
        if known and exists(session, url, repo, known[0]):
            digest, diff_id, size = known
            say(f"layer {number + 1}/{len(layer_plan)} {layer.name}: in the registry already")  # type: ignore[operator]
        else:
            t0 = time.monotonic()
            digest, diff_id, size = push_layer(session, url, repo, layer)
            say(f"layer {number + 1}/{len(layer_plan)} {layer.name}: "  # type: ignore[operator]
                f"{human_bytes(layer.size)} in {len(layer.entries)} entries -> "
                f"{human_bytes(size)} gzip, {time.monotonic() - t0:.1f} s")
            done_layers[layer.name] = [digest, diff_id, size]
            state[key] = done_layers
            state_file.parent.mkdir(parents=True, exist_ok=True)
            state_file.write_text(json.dumps(state, indent=1))
        descriptors.append({"mediaType": LAYER_GZIP, "size": size, "digest": digest})
        diff_ids.append(diff_id)
        history.append({"created": dt.datetime.fromtimestamp(EPOCH, dt.UTC).isoformat(),
                        "created_by": f"imgpipe scale bench: {layer.name}"})
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "created": dt.datetime.fromtimestamp(EPOCH, dt.UTC).isoformat(),
        "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "PYTORCH_VERSION=2.13.0"],
                   "WorkingDir": "/workspace"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids}, "history": history,
    }, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": MANIFEST_V2,
        "config": {"mediaType": CONFIG_V1, "size": len(config),
                   "digest": put_blob(session, url, repo, config)},
        "layers": descriptors}, sort_keys=True).encode()
    reply = session.put(f"{url}/v2/{repo}/manifests/{tag}", data=manifest, timeout=60,
                        headers={"Content-Type": MANIFEST_V2})
    if reply.status_code != 201:
        raise SystemExit(f"error: manifest not accepted: HTTP {reply.status_code} {reply.text}")
    files = sum(1 for layer in layer_plan for e in layer.entries if e.kind == "file")
    return {"reference": f"{registry}/{repo}:{tag}",
            "digest": "sha256:" + hashlib.sha256(manifest).hexdigest(),
            "layers": len(layer_plan), "files": files,
            "unpacked": sum(layer.size for layer in layer_plan),
            "compressed": sum(d["size"] for d in descriptors),
            "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default="127.0.0.1:5000", help="host:port, plain HTTP")
    parser.add_argument("--repo", default="scale/ngc")
    parser.add_argument("--size", default="15G", help="unpacked size (e.g. 5G, 15G)")
    parser.add_argument("--layers", type=int, default=44)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--tag", default=None, help="default: the size, e.g. 15g")
    parser.add_argument("--state", type=Path, default=ROOT / "build" / "bench" / "ngc-image.json",
                        help="layer digests already pushed (a killed run resumes from it)")
    args = parser.parse_args(argv)
    total = parse_size(args.size)
    made = generate(args.registry, args.repo, args.tag or args.size.lower(), total, args.layers,
                    args.seed, args.state, say=lambda text: print(text, file=sys.stderr,
                                                                   flush=True))
    print(json.dumps(made, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
