"""imgpipe.yaml's schema: every key it can say, its default, its type, and what it means.

Frozen pydantic models, ``Settings`` at their top, validated once and passed explicitly
(never a global).  Where the files are and how they merge, key by key, is
``imgpipe.base.configlayers``; this module reads no file.  ``TRUSTED_KEYS`` are what the
threat model trusts (only a file root owns may set them: the layers check it);
``format_validation_error`` turns pydantic's errors into the one line the CLI prints
(``imgpipe.yaml: registry.port: must be an integer``), for every model imgpipe validates.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

# What docs/threat-model.md trusts: who the cache's service account is, the command job
# users run as it, and the audit log with its recorder.  A job user's file naming them would
# make that user's choice everyone's (or turn the site's audit off).
TRUSTED_KEYS = ("enroot.cache_owner", "enroot.cache_writer", "audit.log", "audit.recorder")


RENAMED_ENROOT_KEYS = {"prebuilt": "published", "prebuilt_unpinned": "published_unpinned"}
_SAID: set[str] = set()


def deprecated(what: str) -> None:
    """One line on stderr, once per process, for a spelling an earlier release used."""
    if what not in _SAID:
        _SAID.add(what)
        print(f"imgpipe: deprecated: {what}; the old name is still read", file=sys.stderr)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CredentialsConfig(_Strict):
    """Where registry credentials come from; the file holds them, never imgpipe.yaml."""

    source: Literal["none", "docker-config", "netrc"] = Field(
        default="none", description="where the login for the registry is read: none, the "
        "user's docker config.json, or a netrc file")
    file: Path | None = Field(
        default=None,
        description="docker config.json or netrc path; default ~/.docker/config.json or ~/.netrc",
    )
    allow_http: bool = Field(default=False, description="send these credentials over plain "
                             "http (anyone on the network reads them); without it a login "
                             "the registry asks for over http is refused")


class ServerConfig(_Strict):
    """How `imgpipe registry up` runs the head node's registry."""

    mode: Literal["auto", "container", "binary"] = Field(
        default="auto", description="run the registry as a registry:2 container or as Debian's "
        "docker-registry binary; auto: the container when the engine has the image, else the "
        "binary when it is installed, else the image pulled by the engine")
    image: str = Field(default="registry:2", description="the container image of the registry")
    container_name: str = Field(default="imgpipe-registry",
                                description="the registry container's name")
    bind: str = Field(default="127.0.0.1", description="the address the registry listens on "
                      "(0.0.0.0 on a head node that serves compute nodes)")
    data_dir: Path = Field(default=Path("build/registry/data"),
                           description="where the registry keeps its blobs and manifests")
    state_dir: Path = Field(default=Path("build/registry"),
                            description="the registry's config, pid and log files")
    tls_cert: Path | None = Field(default=None, description="the TLS certificate it serves "
                                  "(with tls_key: https)")
    tls_key: Path | None = Field(default=None, description="the TLS certificate's key")
    htpasswd: Path | None = Field(default=None, description="an htpasswd file: the registry "
                                  "then asks for a login (Basic auth, over TLS)")


class CacheServerConfig(_Strict):
    """How `imgpipe registry cache up` runs a blob cache (nginx) in front of the registry."""

    bind: str = Field(default="127.0.0.1", description="the address the blob cache listens "
                      "on (0.0.0.0 on a rack host that serves its rack; then set allow)")
    port: int = Field(default=5080, ge=1, le=65535, description="the blob cache's port")
    state_dir: Path = Field(default=Path("build/registry-cache"), description="the cache's "
                            "nginx.conf, pid, logs and temporary files")
    cache_dir: Path | None = Field(default=None, description="where cached blobs are kept "
                                   "(default: state_dir/blobs)")
    max_size: str = Field(default="100G", description="the most the cached blobs may take "
                          "(nginx evicts the least recently used beyond it)")
    allow: list[str] = Field(default_factory=list, description="the addresses or CIDRs "
                             "(10.1.0.0/16) that may read from it; empty: whoever reaches "
                             "its port")
    user: str | None = Field(default=None, description="the account nginx's workers run as "
                             "when started by root (default: nobody); its folders are given "
                             "to it")

    @field_validator("max_size")
    @classmethod
    def _size(cls, value: str) -> str:
        from imgpipe.base.units import parse_size

        parse_size(value)
        return value

    @field_validator("allow")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError as exc:
                raise ValueError(f"{entry!r} is not an address or CIDR such as "
                                 "10.1.0.0/16") from exc
        return value

    @field_validator("bind")
    @classmethod
    def _bind(cls, value: str) -> str:
        import ipaddress

        try:
            ipaddress.ip_address(value)
        except ValueError as exc:
            raise ValueError("must be an IP address such as 127.0.0.1 or 0.0.0.0") from exc
        return value


_MIRRORED_HOST = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*"
                            r"(:[0-9]{1,5})?")
_REPOSITORY_PREFIX = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*")


class RegistryConfig(_Strict):
    """The registry imgpipe pushes to and reads from."""

    host: str = Field(default="127.0.0.1", description="the registry's host name as jobs "
                      "and image references write it (the head node)")
    port: int = Field(default=5000, ge=1, le=65535, description="the registry's port")
    scheme: Literal["http", "https"] = Field(default="http", description="https for a "
                                             "registry with TLS (a cluster's); http for one "
                                             "machine")
    ca_file: Path | None = Field(default=None, description="the CA certificate that signed "
                                 "the registry's (a site CA); default: the system's")
    credentials: CredentialsConfig = CredentialsConfig()
    server: ServerConfig = ServerConfig()
    connect_timeout_s: float = Field(default=5.0, gt=0, le=600,
                                     description="give up connecting after this long")
    read_timeout_s: float = Field(default=20.0, gt=0, le=3600,
                                  description="give up after this much silence")
    blob_cache: str | None = Field(default=None, description="a blob cache in front of the "
                                   "registry (http://rack1:5080: `imgpipe registry cache up`, "
                                   "or a Dragonfly dfdaemon's registry mirror): blobs are "
                                   "fetched (GET) through it, checked against their digests, and "
                                   "from the registry itself when it does not answer; "
                                   "manifests always come from the registry")
    cache_server: CacheServerConfig = CacheServerConfig()
    mirrors: dict[str, str] = Field(default_factory=dict, description="other registries whose "
                                    "images the site registry holds (imgpipe mirror), each "
                                    "under a repository prefix (\"\": the same names): "
                                    "{nvcr.io: \"\"} runs a job's nvcr.io#nvidia/pytorch:TAG "
                                    "from HOST:PORT/nvidia/pytorch:TAG, so nodes need no route "
                                    "to nvcr.io; builds take such bases from there too")

    @field_validator("mirrors")
    @classmethod
    def _mirror_names(cls, value: dict[str, str]) -> dict[str, str]:
        for address, prefix in value.items():
            if not _MIRRORED_HOST.fullmatch(address):
                raise ValueError(f"{address!r} is not a registry address such as nvcr.io or "
                                 "registry.example:5000")
            if prefix and not _REPOSITORY_PREFIX.fullmatch(prefix):
                raise ValueError(f"{prefix!r} (for {address}) is not a repository prefix such "
                                 "as ngc or mirrors/ngc (lower-case, / between parts)")
        return value

    @field_validator("blob_cache")
    @classmethod
    def _cache_url(cls, value: str | None) -> str | None:
        if not value:
            return None
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a URL such as http://rack1:5080") from exc
        if (parts.scheme not in ("http", "https") or not parts.hostname
                or parts.path not in ("", "/") or parts.query or parts.fragment
                or parts.username or parts.password):
            raise ValueError(f"{value!r} is not a URL such as http://rack1:5080 (a scheme, "
                             "a host and a port; no path, no login)")
        del port
        return value.rstrip("/")

    @field_validator("host")
    @classmethod
    def _plain_host(cls, value: str) -> str:
        if not value or any(c in value for c in "/:@# \t\n"):
            raise ValueError("must be a host name or IP address without scheme, port or path")
        return value

    @property
    def address(self) -> str:
        """``host:port`` as it appears in image references."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"


class OutputsConfig(_Strict):
    """Where imgpipe writes."""

    squashfs_dir: Path = Field(default=Path("build/squashfs"), description="the squashfs "
                               "folder: conversions and fetched published files (shared by "
                               "every user of a cluster: node-config --make-cache)")
    recipes_dir: Path = Field(default=Path("build/recipes"), description="where `recipes "
                              "render` writes when -o is not given")
    state_dir: Path = Field(default=Path("build/state"), description="build records: what "
                            "was built from which inputs (change detection)")


class DockerConfig(_Strict):
    """Which docker client drives builds: ``auto`` picks one that has BuildKit."""

    client: str = Field(default="auto", description="the docker client to build with (a "
                        "path); auto: one that can drive BuildKit")
    host: str | None = Field(default=None, description="DOCKER_HOST for the engine, if not default")


class SecretSources(_Strict):
    """Where build secrets come from.  Values never enter imgpipe.yaml, a layer or a log."""

    ca_bundle: Path | None = Field(
        default=Path("/etc/ssl/certs/ca-certificates.crt"),
        description="CA bundle for intercepting proxies (used only when the file exists)")
    pip_config: Path | None = Field(default=None, description="a pip.conf handed to builds "
                                    "as a secret (an index that serves the wheels)")
    ngc_api_key_env: str = Field(default="NGC_API_KEY", description="the environment "
                                 "variable holding the NGC API key for nvcr.io pulls")


class BuildConfig(_Strict):
    """How images are built."""

    secrets: SecretSources = SecretSources()
    wheels_dir: Path | None = Field(
        default=None, description="a folder of .whl files offered to builds (air-gapped sites)")
    timeout_s: int = Field(default=7200, ge=60, description="give up a build after this long")
    selftest_timeout_s: int = Field(default=900, ge=10, description="give up a self-test "
                                    "after this long")
    registry_cache: bool = Field(default=True, description="reuse layers from the head-node "
                                 "registry's last push (BuildKit inline cache, or a buildx "
                                 "registry cache): a fresh runner does not rebuild them")
    builders: dict[str, str] = Field(
        default_factory=dict, description="platform -> DOCKER_HOST of a native engine that "
        "builds it (ssh://grace-login or tcp://host:2376); a platform not named here and "
        "not the build host's is built under emulation (qemu-user-static's binfmt)")


class EnrootConfig(_Strict):
    """Squashfs conversion: compression and parallelism for the whole site."""

    # None: by how nodes start jobs.  Unpacking (Pyxis's default) wants the smallest file:
    # zstd.  Mounting (use_squashfuse=1) reads through FUSE on every start: lz4 reads 1.7x
    # faster than zstd for 1.4x the size (bench/bench_squashfuse.py; bench/README.md).
    compression: Literal["zstd", "lz4", "lzo-enroot", "none"] | None = Field(
        default=None, description="the squashfs compression; default: zstd, or lz4 with "
        "squashfuse")
    squashfuse: bool = Field(default=False, description="nodes run Pyxis with "
                             "use_squashfuse=1 (jobs mount squashfs files, never unpack)")
    zstd_level: int = Field(default=3, ge=1, le=22, description="zstd's level (3: Enroot's "
                            "speed, a third smaller than lzo)")
    processors: int = Field(default=0, ge=0, description="0: every core")
    # Off by default, as in Enroot: every blob is checked against the digest the manifest
    # pins, and the squashfs is made from those bytes alone, so a config whose diff_ids do
    # not match its layers cannot change what a job runs; the check costs a sha256 of the
    # whole unpacked image (16 GB: 11 CPU-seconds, a tenth of a conversion on two cores).
    verify_diff_ids: bool = Field(default=False, description="also hash every layer's tar "
                                  "against the image config's diff_id while converting and "
                                  "refuse an image whose config does not match its layers "
                                  "(blobs are always checked against their digests)")
    max_connections: int = Field(default=4, ge=1, le=64, description="layers fetched in "
                                 "parallel by a conversion (Enroot's ENROOT_MAX_CONNECTIONS)")
    range_connections: int = Field(default=4, ge=1, le=64, description="byte ranges of a "
                                   "published squashfs fetched at once, each checked against "
                                   "the chunk digests published with it (a bad range is "
                                   "fetched again alone); 1: one stream")
    cache_max_size: str | None = Field(default=None, description="prune the shared cache "
                                       "to this size (e.g. 500G) after each conversion")
    published: bool = Field(default=True, description="fetch a squashfs published beside "
                            "the image (imgpipe push --squashfs) when a pin names it, instead "
                            "of converting; false: always convert (--no-published)")
    published_unpinned: bool = Field(default=False, description="also use a published "
                                     "squashfs no pin names: this trusts every account that "
                                     "can push to the registry (and, over plain http, the "
                                     "network) to attach only genuine squashfs files; the file "
                                     "is still checked for device nodes and for set-id files "
                                     "the image's layers lack.  In a shared cache it opts in "
                                     "for your own jobs only: others never receive what it "
                                     "fetched")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, values: object) -> object:
        """Keys of earlier releases still read, each with a one-line notice."""
        if isinstance(values, dict):
            for old, new in RENAMED_ENROOT_KEYS.items():
                if old in values:
                    deprecated(f"enroot.{old} is now enroot.{new}")
                    values = {**{k: v for k, v in values.items() if k != old},
                              new: values[old], **({new: values[new]} if new in values
                                                   else {})}
        return values
    cache_owner: str | None = Field(default=None, description="the service account that, with "
                                    "root, owns the shared squashfs folder's layout and writes "
                                    "the entries every user's jobs take as they are (`imgpipe "
                                    "node-config --make-cache`); job users' own conversions "
                                    "are theirs alone")
    cache_writer: str | None = Field(default=None, description="the command (with its "
                                     "leading arguments) that job users may run as "
                                     "cache_owner through sudo, e.g. '/usr/local/bin/"
                                     "imgpipe-cache-writer --config /etc/imgpipe/imgpipe.yaml': "
                                     "conversions in the shared cache are then made by the "
                                     "service account and taken by every user's jobs")
    lock_timeout_s: float = Field(default=3600.0, gt=0, description="give up waiting for "
                                  "another process's conversion of the same digest after this "
                                  "long, naming the holder")
    publish_compressions: list[Literal["zstd", "lz4", "lzo-enroot", "none"]] = Field(
        default=["zstd"], min_length=1, description="what `imgpipe push --squashfs` publishes "
        "(lzo-enroot for nodes with kernels older than 4.14)")
    version: str | None = Field(default=None, description="Enroot's version on the compute "
                                "nodes (e.g. 3.5.0); default: the enroot on this host.  Enroot "
                                "3.x cannot pull by digest: recipes then pin squashfs files")

    distribution: Literal["shared", "fetch", "sbcast", "broadcast"] = Field(
        default="shared", description="how jobs get their image onto the nodes: shared "
        "(outputs.squashfs_dir is on the cluster file system: the first node's import serves "
        "every node), fetch (a node-local squashfs_dir: each node's importer fetches for "
        "itself), sbcast (a node-local squashfs_dir: the job's batch host gets the image "
        "once and Slurm's sbcast copies it to every node, each node checking its sha256) or "
        "broadcast (node-local too: the batch host's fetch is streamed to every node over "
        "MPI while it arrives, each node hashing as it receives; needs Open MPI, "
        "python3-mpi4py and Slurm's pmix plugin, else sbcast)")
    sbcast_fanout: int = Field(default=4, ge=1, le=64, description="sbcast's message tree "
                               "width (--fanout; Slurm 22.05 takes at most 8)")
    sbcast_block: str = Field(default="8M", description="sbcast's block size (--size): "
                              "each block reaches every node before the next is sent")
    importer_path: str = Field(default="/usr/local/bin/imgpipe-pyxis-importer",
                               description="the importer on the compute nodes, as the "
                               "recipes run it to stage images (fetch, sbcast and broadcast)")
    pyxis_importer: bool | None = Field(
        default=None, description="whether the nodes' Pyxis line has importer= (`node-config "
        "--accept importer`; `site init --pyxis-importer`): true, the recipes pin images by "
        "digest and the importer serves them; false, they pin the squashfs file `imgpipe "
        "convert` made in the shared folder (refused until it exists); unset, a converted "
        "file when this checkout's lock holds one and the folder is shared, else the digest")

    @property
    def default_compression(self) -> str:
        """The compression conversions use when nothing more specific says."""
        return self.compression or ("lz4" if self.squashfuse else "zstd")

    @field_validator("version")
    @classmethod
    def _version(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"v?\d+\.\d+(\.\d+)?", value.strip()):
            raise ValueError("must be a version such as 3.5 or 4.1.2")
        return value

    @field_validator("sbcast_block")
    @classmethod
    def _block(cls, value: str) -> str:
        if not re.fullmatch(r"[1-9][0-9]{0,9}[kKmMgG]?", value):
            raise ValueError("must be a size sbcast takes, such as 8M or 64M")
        return value

    @field_validator("importer_path")
    @classmethod
    def _importer(cls, value: str) -> str:
        if not value.startswith("/") or "\n" in value or "\x00" in value:
            raise ValueError("must be an absolute path on the compute nodes")
        return value

    @field_validator("cache_max_size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            from imgpipe.base.units import parse_size

            parse_size(value)
        return value


class RecipesConfig(_Strict):
    """What `imgpipe recipes render` writes into the job scripts: the cluster's paths."""

    profiles_dir: Path | None = Field(default=None, description="a site's own profiles "
                                      "(NAME.yaml; `imgpipe recipes profile new`)")
    data_dir: str = Field(default="/lustre/bert/data", description="the prepared HDF5 shards "
                          "(dataset.sub writes, run.sub reads), on the cluster filesystem")
    checkpoint_dir: str = Field(default="/lustre/bert/checkpoints",
                                description="training checkpoints")
    results_dir: str = Field(default="/lustre/bert/results", description="logs, NCCL results "
                             "and each job's record of its image (imgpipe report reads it)")
    dataset_source: str = Field(default="/lustre/bert/source", description="the raw text "
                                "dataset.sub prepares (a Wikipedia dump, or text files)")
    vocab: str = Field(default="/lustre/bert/vocab.txt", description="the WordPiece "
                       "vocabulary")
    bert_config: str = Field(default="",
                             description="a host file with the model config (empty: the image's)")
    partition: str | None = Field(default=None, description="the Slurm partition of every "
                                  "job (default: the profile's)")
    walltime_minutes: int = Field(default=480, ge=1, description="run.sub's time limit "
                                  "(#SBATCH --time)")


class AuditConfig(_Strict):
    """The audit log of the node side: who imported what (docs/admin.md, "Audit log")."""

    log: str | None = Field(default=None, description="a JSON-lines file, root's and 0600, "
                            "that gets one line per import and cache-writer conversion (who, "
                            "what, when, from which registry, as which digest), appended by "
                            "the recorder through sudo; unset: no audit")
    recorder: str = Field(default="/opt/imgpipe/bin/imgpipe-audit", description="the "
                          "imgpipe-audit program job users run as root through sudo, as the "
                          "sudoers line names it")

    @field_validator("log", "recorder")
    @classmethod
    def _path(cls, value: str | None) -> str | None:  # what sudoers and logrotate read as one
        if value is not None and not re.fullmatch(r"(/[A-Za-z0-9_+-][A-Za-z0-9._+-]*)+", value):
            raise ValueError("must be an absolute path of letters, digits and . _ + -")
        return value


class Settings(_Strict):
    """Everything imgpipe.yaml can say; passed explicitly, never a global."""

    registry: RegistryConfig = RegistryConfig()
    outputs: OutputsConfig = OutputsConfig()
    images_dir: Path = Field(default=Path("images"), description="the image catalog: a "
                             "folder per image (image.yaml, Dockerfile, payload)")
    docker: DockerConfig = DockerConfig()
    build: BuildConfig = BuildConfig()
    enroot: EnrootConfig = EnrootConfig()
    recipes: RecipesConfig = RecipesConfig()
    audit: AuditConfig = AuditConfig()
    default_flavor: Literal["ngc", "cpu"] = Field(
        default="cpu", description="the flavor built and rendered when none is named: cpu on "
        "one machine (no NGC pull), ngc on a GPU cluster (`imgpipe site init` sets it)")
    # Folder relative paths resolve against; not a key in the file.
    root: Path = Field(default=Path("."), exclude=True)
    source: Path | None = Field(default=None, exclude=True)
    # Which file set each key a layer set ("registry.host" -> "/etc/imgpipe/imgpipe.yaml").
    origins: dict[str, str] = Field(default_factory=dict, exclude=True)

    def path(self, value: Path) -> Path:
        """``value`` resolved against the config file's folder."""
        return value if value.is_absolute() else (self.root / value)


def format_validation_error(path: Path, exc: ValidationError) -> str:
    """``file: a.b.c: message`` for the first error (one line, as the CLI prints)."""
    first = exc.errors()[0]
    key = ".".join(str(part) for part in first["loc"]) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        message = "unknown key"
    elif kind == "literal_error":
        expected = first.get("ctx", {}).get("expected", "")
        message = f"must be one of {expected.replace(' or ', ', ')}"
    elif kind in ("int_parsing", "int_type"):
        message = f"must be an integer, not {first.get('input')!r}"
    elif kind in ("bool_parsing", "bool_type"):
        message = "must be true or false"
    elif kind in ("model_type", "dict_type"):
        message = "must be a mapping"
    else:
        message = first["msg"].removeprefix("Value error, ")
    more = len(exc.errors()) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return f"{path}: {key}: {message}{suffix}"
