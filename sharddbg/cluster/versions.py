"""The torch and physicsnemo versions sharddbg was tested with, and the one warning for any other."""

from __future__ import annotations

import warnings

from ..errors import ShardDbgWarning

# Versions sharddbg was tested with; anything else gets one clear warning and still runs.
TESTED_VERSIONS = {"torch": ("2.14.1", "2.11"), "physicsnemo": ("2.2.2",)}

# (package, version) pairs warned about in this process: each is warned about once.
WARNED: set[tuple[str, str]] = set()


def tested_version(package: str, version: str) -> bool:
    """``version`` of ``package`` is one sharddbg was tested with (a local build suffix, ``+cu130``, or a
    patch release of a tested ``major.minor`` counts)."""
    return any(version == v or version.startswith(v + ".") or version.startswith(v + "+")
               for v in TESTED_VERSIONS[package])


def check_versions(statuses: list[dict], warned: set[tuple[str, str]] | None = None) -> list[str]:
    """Warn (``ShardDbgWarning``) about each untested torch / physicsnemo version the engines report in
    ``statuses`` (rows of ``Cluster.status()``), once per version: ``warned`` holds the pairs already
    warned about (this process's by default). Returns the warnings issued now."""
    warned = WARNED if warned is None else warned
    issued = []
    for package in TESTED_VERSIONS:
        for version in sorted({s.get(package, "") for s in statuses}):
            if version and not tested_version(package, version) and (package, version) not in warned:
                warned.add((package, version))
                message = (f"sharddbg was tested with {package} {' / '.join(TESTED_VERSIONS[package])}, "
                           f"the engines run {package} {version}: it will still run; if something looks wrong, "
                           f"that difference is the first suspect.")
                warnings.warn(message, ShardDbgWarning, stacklevel=3)
                issued.append(message)
    return issued
