"""Manifest media types of the Registry HTTP API v2 (Docker schema 2 and OCI), and the
header that marks an answer as a registry's.

Their own module, with nothing heavier than strings, so that fast paths (the Pyxis
importer's) can speak to a registry without importing the HTTP client.
"""

from __future__ import annotations

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
INDEX_TYPES = {DOCKER_LIST, OCI_INDEX}
MANIFEST_ACCEPT = ", ".join([DOCKER_MANIFEST, DOCKER_LIST, OCI_MANIFEST, OCI_INDEX])
# Every answer of a registry carries it; an error without it came from something in front
# (a web server's 404 is not "no such image"; a blob cache's failure is not the registry's).
REGISTRY_HEADER = "Docker-Distribution-API-Version"
