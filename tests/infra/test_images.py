"""The container images and the compose stack, checked without a container runtime
(none can run here): hadolint on the Dockerfiles, their stages parsed with the Docker
parser, and compose.yaml's wiring (services, files, names, ports) read as YAML."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import dockerfile
import pytest
import yaml

from gateway.settings import Settings
from tests.infra.conftest import INFRA, ROOT, known_env_vars

DOCKER = INFRA / "docker"
DOCKERFILES = (DOCKER / "Dockerfile", DOCKER / "backend-cuda.Dockerfile")
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or "hadolint"
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make", "cmake", "python3-dev", "git")


def _stages(path: Path) -> dict[str, list[dockerfile.Command]]:
    """Instructions by stage name (FROM ... AS name)."""
    stages: dict[str, list[dockerfile.Command]] = {}
    current: list[dockerfile.Command] = []
    for command in dockerfile.parse_file(str(path)):
        if command.cmd == "FROM":
            current = []
            stages[command.value[-1]] = current
        current.append(command)
    return stages


def _final_stages() -> list[tuple[str, list[dockerfile.Command]]]:
    """The stages an image is built from, with everything they inherit."""
    chains = []
    for path in DOCKERFILES:
        stages = _stages(path)
        for name in ("gateway", "backend"):
            if name not in stages:
                continue
            chain: list[dockerfile.Command] = []
            stage: str | None = name
            while stage in stages:
                chain = stages[stage] + chain
                stage = stages[stage][0].value[0]  # FROM <parent> AS name
            chains.append((f"{path.name}:{name}", chain))
    return chains


def test_hadolint_passes() -> None:
    result = subprocess.run(
        [HADOLINT, "--config", str(DOCKER / ".hadolint.yaml"), *map(str, DOCKERFILES)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("image", "commands"), _final_stages(), ids=lambda v: str(v)[:40])
def test_final_images_run_as_non_root_with_a_healthcheck(
    image: str, commands: list[dockerfile.Command]
) -> None:
    users = [c.value[0] for c in commands if c.cmd == "USER"]
    assert users, f"{image} runs as root"
    assert users[-1].split(":")[0] not in ("0", "root")
    checks = [c for c in commands if c.cmd == "HEALTHCHECK"]
    assert checks and "/healthz" in checks[-1].original
    entrypoint = [c for c in commands if c.cmd == "ENTRYPOINT"]
    assert entrypoint and entrypoint[-1].value == ("tollgate",)


@pytest.mark.parametrize(("image", "commands"), _final_stages(), ids=lambda v: str(v)[:40])
def test_final_images_hold_no_build_tools_or_caches(
    image: str, commands: list[dockerfile.Command]
) -> None:
    runs = " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    installed = re.findall(r"apt-get install[^&]*", runs)
    for tool in BUILD_TOOLS:
        assert not any(re.search(rf"\s{re.escape(tool)}(\s|$)", i) for i in installed), tool
    assert "pip install" not in runs  # the environment comes ready from the build stage
    for install in installed:  # apt lists go in the same layer they were made in
        assert "rm -rf /var/lib/apt/lists" in runs, install
    copies = [c.original for c in commands if c.cmd == "COPY"]
    assert copies == ["COPY --from=build /opt/tollgate /opt/tollgate"], copies


def test_the_cuda_image_starts_from_nvidia_cuda_runtime() -> None:
    args = [c.value[0] for c in dockerfile.parse_file(str(DOCKERFILES[1])) if c.cmd == "ARG"]
    base = next(a.split("=", 1)[1] for a in args if a.startswith("CUDA_IMAGE="))
    assert base.startswith("nvidia/cuda:") and "-runtime-" in base


def test_images_copy_what_the_wheel_packages() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include = \[([^\]]+)\]", pyproject)
    assert packages
    wanted = {name.strip().strip('"').rstrip("*") for name in packages.group(1).split(",")}
    for path in DOCKERFILES:
        copied = {c.value[0] for c in dockerfile.parse_file(str(path)) if c.cmd == "COPY"}
        assert wanted <= copied, (path.name, wanted - copied)
        ignore = Path(f"{path}.dockerignore").read_text().split()
        assert {f"!{name}" for name in wanted} <= set(ignore)


# --- compose.yaml ----------------------------------------------------------------------


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((INFRA / "compose.yaml").read_text())
    return loaded


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (service.get("environment") or {}).items()}


def test_compose_has_the_whole_stack() -> None:
    services = _compose()["services"]
    wanted = {"postgres", "redis", "migrate", "gateway-0", "gateway-1", "lb", "backend-0",
              "backend-1", "worker", "beat", "otel-collector", "prometheus", "grafana"}  # fmt: skip
    assert wanted <= set(services)
    for name, service in services.items():
        for dependency in service.get("depends_on") or {}:
            assert dependency in services, (name, dependency)
    for gateway in ("gateway-0", "gateway-1", "worker", "beat"):
        assert services[gateway]["depends_on"]["migrate"] == {
            "condition": "service_completed_successfully"
        }
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert "replicas" not in (services["beat"].get("deploy") or {})  # beat: exactly one


def test_compose_env_names_are_settings_the_code_reads() -> None:
    for name, service in _compose()["services"].items():
        for var in _env(service):
            if var.startswith("TOLLGATE_"):
                assert var in known_env_vars(), (name, var)


def test_compose_gateway_env_is_accepted_by_settings() -> None:
    env = _env(_compose()["services"]["gateway-0"])
    filled = {k: re.sub(r"\$\{[^}]*\}", "value", v) for k, v in env.items()}
    settings = Settings.from_env(filled)
    assert settings.backends == ("http://backend-0:9000", "http://backend-1:9000")
    assert settings.database_url.startswith("postgresql+psycopg://")
    assert settings.redis_url == "redis://redis:6379/0"


def test_compose_workers_consume_the_billing_and_the_batch_queues_apart() -> None:
    """A batch run holds its worker slot for minutes: the relay's worker is another."""
    services = _compose()["services"]
    env = {k: re.sub(r"\$\{[^}]*\}", "value", v) for k, v in _env(services["worker"]).items()}
    settings = Settings.from_env(env)
    queues = {}
    for name in ("worker", "batch-worker"):
        command = services[name]["command"]
        queues[name] = command[command.index("-Q") + 1]
    assert queues == {"worker": settings.celery_queue, "batch-worker": settings.celery_batch_queue}
    assert services["batch-worker"]["depends_on"]["migrate"] == {
        "condition": "service_completed_successfully"
    }


def test_compose_files_it_mounts_exist() -> None:
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (INFRA / source).exists(), (name, source)
    dashboards = INFRA / "grafana"
    assert list(dashboards.glob("*.json"))


def test_prometheus_and_nginx_point_at_the_compose_services() -> None:
    services = _compose()["services"]
    prometheus = yaml.safe_load((INFRA / "compose" / "prometheus.yml").read_text())
    targets = {
        target
        for job in prometheus["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    assert targets == {"gateway-0:8000", "gateway-1:8000", "backend-0:9000", "backend-1:9000"}
    for job in prometheus["scrape_configs"]:
        secret = Path(job["authorization"]["credentials_file"]).name
        assert secret in services["prometheus"]["secrets"]
    nginx = (INFRA / "compose" / "nginx.conf").read_text()
    upstreams = set(re.findall(r"server (\S+:\d+)", nginx))
    assert upstreams == {"gateway-0:8000", "gateway-1:8000"}
    assert "proxy_buffering off" in nginx  # server-sent events stream through
    retry = re.search(r"proxy_next_upstream ([^;]+);", nginx)
    assert retry and {"http_503", "non_idempotent"} <= set(retry.group(1).split())


def test_compose_stops_gateways_and_backends_after_their_drain() -> None:
    from gateway.cli.drain import SETTLE_S

    for name, service in _compose()["services"].items():
        drain = _env(service).get("TOLLGATE_DRAIN_S")
        if drain is None:
            continue
        grace = int(service["stop_grace_period"].removesuffix("s"))
        assert grace > int(drain) + SETTLE_S, name
    services = _compose()["services"]
    assert all("TOLLGATE_DRAIN_S" in _env(services[n]) for n in ("gateway-1", "backend-1"))
