"""The blob cache's nginx.conf: a collapsing HTTP cache in front of the registry.

What it lets through, and why (docs/admin.md, "A cache tier for racks"):

* Only ``GET``/``HEAD /v2/<name>/blobs/sha256:<64 hex>`` is proxied, and cached by the
  digest alone (the same layer in two repositories is one entry); every other path gets
  404 from nginx itself, so manifests, tags, uploads and token requests never pass through
  it.  imgpipe sends only blob downloads (``GET``) here (registry.cacheroute); it checks
  every byte against its digest, so a cache cannot change what a job runs.
* Blobs are cached in slices (nginx's ``slice`` module): the registry is asked for
  ``SLICE``-sized ranges, each cached under ``digest + range``.  A ``Range`` request on a
  miss then costs only the slices it covers, and ``proxy_cache_lock`` collapses concurrent
  misses per slice: the first request fetches it, the others wait for that one slice (a few
  hundred milliseconds), never for a whole multi-GB blob, so no client's read timeout runs
  out while another fetches.
* Credentials: the registry decides every read, hit or miss.  Before a blob is served
  (from the cache or not), nginx's ``auth_request`` asks the registry ``HEAD /v2/<name>/
  blobs/<digest>`` with the client's own ``Authorization``: only a 2xx lets the blob out; a
  401 or 403 goes back to the client with the registry's challenge, so a user the registry
  would refuse reads nothing cached, under any repository name (and a 404, a blob its
  repository does not hold, is the client's answer too; a registry that cannot be asked
  gives 502).  The ``Authorization`` is never part of the cache key, and only 200
  and 206 answers are stored (401, 403, 404, redirects and errors never; the registry's
  ``Cache-Control``, ``Set-Cookie`` and ``Vary`` are ignored, ``Set-Cookie`` is not passed
  on).  ``allow`` limits who reaches the port at all.
* Every path nginx writes (pid, logs, temporary files, the cache) lies in the state folder:
  it never touches ``/etc/nginx``, ``/var/log/nginx`` or ``/var/lib/nginx``.  The logs name
  repositories and digests: they are 0600 (registry.blobcache makes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from imgpipe.base.units import parse_size

__all__ = ["AUTH_PATH", "HEALTH_BODY", "HEALTH_PATH", "SLICE", "TEMP_FOLDERS", "NginxLayout",
           "render"]

SLICE = "16m"  # one upstream range request per slice; a waiter waits for one slice at most
HEALTH_PATH = "/imgpipe-blob-cache"
HEALTH_BODY = "imgpipe blob cache"
AUTH_PATH = "/imgpipe-may-read"  # the internal subrequest that asks the registry
# A repository name as the distribution spec writes it: nothing else is passed upstream.
REPOSITORY = "[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
TEMP_FOLDERS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


@dataclass(frozen=True)
class NginxLayout:
    """What the rendered configuration names: where it listens and writes, and upstream."""

    upstream: str  # the registry's base URL, http(s)://host:port
    bind: str
    port: int
    state_dir: Path
    cache_dir: Path
    max_size: str
    allow: tuple[str, ...] = ()
    user: str | None = None  # workers' account when the master runs as root
    ca_file: Path | None = None  # the registry's CA, for an https upstream

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "nginx.pid"

    @property
    def error_log(self) -> Path:
        return self.state_dir / "error.log"

    @property
    def access_log(self) -> Path:
        return self.state_dir / "access.log"

    @property
    def temp_dir(self) -> Path:
        return self.state_dir / "tmp"


def _nginx_size(text: str) -> str:
    """imgpipe's ``100G`` as nginx writes sizes: whole MiB, at least one."""
    return f"{max(parse_size(text) // (1 << 20), 1)}m"


def render(layout: NginxLayout) -> str:
    """The complete nginx.conf; nginx runs it as ``nginx -c FILE -p STATE -e ERRLOG``."""
    state, temp = layout.state_dir, layout.temp_dir
    temp_lines = "\n".join(f"    {name}_temp_path {temp / name};" for name in TEMP_FOLDERS)
    access = "".join(f"        allow {entry};\n" for entry in layout.allow)
    if layout.allow:
        access += "        deny all;\n"
    tls = ""
    if layout.upstream.startswith("https://"):
        tls = "            proxy_ssl_server_name on;\n            proxy_ssl_verify on;\n"
        trusted = layout.ca_file or Path("/etc/ssl/certs/ca-certificates.crt")
        tls += f"            proxy_ssl_trusted_certificate {trusted};\n"
    user = f"user {layout.user};\n" if layout.user else ""
    return f"""\
# imgpipe blob cache (`imgpipe registry cache config`): nginx in front of {layout.upstream}.
# Run it as: nginx -c {state / 'nginx.conf'} -p {state} -e {layout.error_log}
# Only blobs by digest pass; see docs/admin.md, "A cache tier for racks".
{user}daemon off;
worker_processes auto;
pid {layout.pid_file};
error_log {layout.error_log} warn;

events {{
    worker_connections 1024;
}}

http {{
    server_tokens off;
    default_type application/octet-stream;
    log_format imgpipe_cache '$remote_addr [$time_local] "$request" $status '
                             '$body_bytes_sent cache=$upstream_cache_status '
                             'upstream=$upstream_status';
    access_log {layout.access_log} imgpipe_cache;
{temp_lines}
    proxy_cache_path {layout.cache_dir} levels=2:2 keys_zone=imgpipe_blobs:64m
                     max_size={_nginx_size(layout.max_size)} inactive=30d use_temp_path=off;

    server {{
        listen {layout.bind}:{layout.port};
{access}        client_max_body_size 1k;

        location = {HEALTH_PATH} {{
            return 200 "{HEALTH_BODY}\\n";
        }}

        location ~ "^/v2/(?<blob_repo>{REPOSITORY})/blobs/(?<blob_digest>sha256:[0-9a-f]{{64}})$" {{
            limit_except GET {{ deny all; }}
            auth_request {AUTH_PATH};
            auth_request_set $imgpipe_may_read $upstream_status;
            error_page 500 = @imgpipe_not_read;
            slice {SLICE};
            proxy_cache imgpipe_blobs;
            proxy_cache_key $blob_digest$slice_range;
            proxy_set_header Range $slice_range;
            proxy_cache_valid 200 206 30d;
            proxy_ignore_headers Cache-Control Expires X-Accel-Expires Set-Cookie Vary;
            proxy_hide_header Set-Cookie;
            proxy_cache_lock on;
            proxy_cache_lock_timeout 300s;
            proxy_cache_lock_age 300s;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering on;
            proxy_max_temp_file_size 0;
            proxy_connect_timeout 5s;
            proxy_read_timeout 120s;
{tls}            proxy_pass {layout.upstream};
        }}

        location = {AUTH_PATH} {{
            internal;
            rewrite ^ /v2/$blob_repo/blobs/$blob_digest break;
            proxy_method HEAD;
            proxy_pass_request_body off;
            proxy_set_header Content-Length "";
            proxy_set_header Range "";
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_connect_timeout 5s;
            proxy_read_timeout 30s;
{tls}            proxy_pass {layout.upstream};
        }}

        location @imgpipe_not_read {{
            if ($imgpipe_may_read = 404) {{
                return 404;
            }}
            return 502;
        }}

        location / {{
            return 404;
        }}
    }}
}}
"""
