"""The Helm chart, rendered offline with Helm's own SDK (helm-python-sdk: no helm binary,
no cluster) for several value sets, linted, and every object validated against the
Kubernetes 1.30 schemas bundled in kubernetes-validate; then the objects that matter are
checked against the product itself: env names the code reads, probes on its real routes,
credentials only in Secrets, one beat, requests and non-root everywhere."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, cast

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.infra.conftest import INFRA, known_env_vars

CHART = INFRA / "helm" / "tollgate"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "tg", "llm"
FULLNAME = "tg-tollgate"
CRD_KINDS = {"ScaledObject", "ServiceMonitor"}  # no bundled schema: checked field by field

EXTERNAL = {
    "postgresql": {"enabled": False},
    "redis": {"enabled": False},
    "externalDatabase": {"url": "postgresql+psycopg://app:pw@db.example:5432/tollgate"},
    "externalRedis": {"url": "redis://cache.example:6379/0"},
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu": {
        "backend": {
            "gpu": {"enabled": True, "count": 2},
            "model": {"path": "/models/llama", "existingClaim": "models"},
        }
    },
    "external-databases": EXTERNAL,
    "existing-secret": {**EXTERNAL, "secrets": {"existingSecret": "tollgate-prod"}},
    "autoscaling": {
        "backend": {"autoscaling": {"enabled": True}},
        "serviceMonitor": {"enabled": True},
        "networkPolicy": {
            "gatewayIngressFrom": [{"namespaceSelector": {"matchLabels": {"name": "ingress"}}}]
        },
    },
}

# Everything optional switched off or the other way, so every template branch renders.
VALUE_SETS["toggles"] = {
    "gateway": {
        "autoscaling": {"enabled": False},
        "podDisruptionBudget": {"enabled": False},
        "trustedProxies": ["10.0.0.0/8"],
        "extraEnv": {"TOLLGATE_METRICS_TOP_TENANTS": "50"},
    },
    "backend": {
        "podDisruptionBudget": {"enabled": False},
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
    },
    "worker": {"podDisruptionBudget": {"enabled": False}},
    "networkPolicy": {"enabled": False},
    "config": {
        "preStopSeconds": 0,
        "otlpEndpoint": "http://otel-collector.monitoring:4318",
        "s3": {"bucket": "tollgate-files", "endpointUrl": "http://minio.storage:9000"},
    },
    "imagePullSecrets": [{"name": "registry"}],
    "secrets": {
        "adminKey": "tg-abcdefgh_" + "x" * 43,
        "s3AccessKeyId": "files-id",
        "s3SecretAccessKey": "files-secret",
    },
}
WITH_BUDGETS = pytest.mark.parametrize("values", sorted(set(VALUE_SETS) - {"toggles"}))

Doc = dict[str, Any]


@cache
def _chart() -> helm.Chart:
    return helm.Chart.load(str(CHART))


@cache
def _render(name: str) -> tuple[tuple[str, str], ...]:
    rendered = _chart().render(VALUE_SETS[name], name=RELEASE, namespace=NAMESPACE,
                               is_install=True)  # fmt: skip
    return tuple(sorted(rendered.items()))


def _docs(name: str) -> list[Doc]:
    docs: list[Doc] = []
    for path, text in _render(name):
        if path.endswith(".yaml"):
            docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def _notes(name: str) -> str:
    return next(text for path, text in _render(name) if path.endswith("NOTES.txt"))


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _pod_specs(docs: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def _containers(pod: Doc) -> list[Doc]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _secret_values(docs: list[Doc]) -> set[str]:
    return {
        value
        for doc in docs
        if doc["kind"] == "Secret"
        for value in doc.get("stringData", {}).values()
        if len(value) >= 8
    }


def _container_env(docs: list[Doc], container: Doc) -> dict[str, str]:
    """A container's environment as the kubelet would build it."""
    secrets = {
        d["metadata"]["name"]: d.get("stringData", {}) for d in docs if d["kind"] == "Secret"
    }
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        value = secrets.get(ref["name"], {}).get(ref["key"])
        if value is None and not ref.get("optional"):
            value = f"<{ref['name']}/{ref['key']}>"  # an existing Secret, out of the chart
        if value is not None:
            env[item["name"]] = value
    return env


@cache
def _routes() -> dict[str, frozenset[str]]:
    """The paths the gateway and the backend really serve."""
    from backend.server import create_backend_app
    from gateway.app import create_app
    from gateway.settings import Settings

    gateway = create_app(Settings.from_env({"TOLLGATE_DATA_DIR": "/nonexistent"}))
    backend = create_backend_app(cast(Any, None), Path("."), "secret")
    return {
        "gateway": frozenset(route.path for route in gateway.routes),
        "backend": frozenset(route.path for route in backend.routes),
    }


ALL = pytest.mark.parametrize("values", sorted(VALUE_SETS))


# --- Helm's own checks -------------------------------------------------------------------


@ALL
def test_lint_is_clean(values: str) -> None:
    report = helm.lint(str(CHART), VALUE_SETS[values], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")  # fmt: skip
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@ALL
def test_values_pass_the_schema(values: str) -> None:
    _chart().validate_schema(VALUE_SETS[values])


@pytest.mark.parametrize(
    "bad",
    [
        {"backend": {"gpu": {"count": 0}}},
        {"gateway": {"replicas": "two"}},
        {"secrets": {"adminKey": "not-a-tollgate-key"}},
        {"externalDatabase": {"url": "mysql://db/tollgate"}},
        {"backend": {"autoscaling": {"kvCacheThreshold": 1.5}}},
        {"gateway": {"typo": True}},
    ],
)
def test_the_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        _chart().validate_schema(bad)


def test_external_database_without_a_url_fails_to_render() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"externalDatabase\.url"):
        _chart().render({"postgresql": {"enabled": False}}, name=RELEASE, namespace=NAMESPACE)


# --- Kubernetes schemas --------------------------------------------------------------------


@ALL
def test_every_object_is_valid_kubernetes(values: str) -> None:
    for doc in _docs(values):
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_custom_resources_are_the_known_ones_without_a_bundled_schema() -> None:
    """Only KEDA's and prometheus-operator's objects skip schema validation (they are
    checked field by field below), and only because kubernetes-validate has no schema."""
    found = {(d["apiVersion"], d["kind"]) for d in _docs("autoscaling") if d["kind"] in CRD_KINDS}
    assert found == {
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
    }
    for api_version, kind in found:
        probe = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}}
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(probe, KUBE_VERSION, strict=True)


# --- the product's names, routes and secrets --------------------------------------------


@ALL
def test_env_names_are_settings_the_code_reads(values: str) -> None:
    docs = _docs(values)
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            for key in doc["data"]:
                assert key in known_env_vars() or key.startswith("OTEL_"), key
    for name, pod in _pod_specs(docs):
        for container in _containers(pod):
            for item in container.get("env", []):
                var = item["name"]
                assert var in known_env_vars() or not var.startswith("TOLLGATE_"), (name, var)


@ALL
def test_gateway_and_backend_env_is_accepted_by_settings(values: str) -> None:
    from gateway.settings import Settings

    docs = _docs(values)
    gateway = _one(docs, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    settings = Settings.from_env(_container_env(docs, gateway["containers"][0]))
    assert settings.backends == (f"dns://{FULLNAME}-backend.{NAMESPACE}.svc:9000",)
    assert settings.backend_secret and settings.admin_key and settings.redis_url
    if values != "existing-secret":  # there the URLs live in a Secret the chart never sees
        assert settings.database_url.startswith("postgresql")
    backend = _one(docs, "Deployment", f"{FULLNAME}-backend")["spec"]["template"]["spec"]
    backend_settings = Settings.from_env(_container_env(docs, backend["containers"][0]))
    assert backend_settings.backend_secret == settings.backend_secret
    if values != "existing-secret":  # the admin key the chart made is a valid Tollgate key
        from tenants.keys import key_prefix

        assert settings.admin_key and key_prefix(settings.admin_key)


@pytest.mark.parametrize("values", ["defaults", "toggles"])
def test_workers_reach_the_backends_and_the_file_store_the_gateways_use(values: str) -> None:
    from gateway.settings import Settings

    docs = _docs(values)
    settings = {
        component: Settings.from_env(
            _container_env(
                docs,
                _one(docs, "Deployment", f"{FULLNAME}-{component}")["spec"]["template"]["spec"][
                    "containers"
                ][0],
            )
        )
        for component in ("gateway", "worker", "beat")
    }
    gateway = settings["gateway"]
    for component in ("worker", "beat"):
        assert settings[component].backends == gateway.backends
        assert settings[component].backend_secret == gateway.backend_secret
        assert settings[component].s3 == gateway.s3
    if values == "toggles":  # the bucket and its credentials, from the ConfigMap and Secret
        assert gateway.s3 is not None and gateway.s3.bucket == "tollgate-files"
        assert gateway.s3.endpoint_url == "http://minio.storage:9000"
        assert (gateway.s3.access_key_id, gateway.s3.secret_access_key) == (
            "files-id",
            "files-secret",
        )
    else:
        assert gateway.s3 is None


@ALL
def test_probes_point_at_real_routes(values: str) -> None:
    routes = _routes()
    docs = _docs(values)
    for component in ("gateway", "backend"):
        pod = _one(docs, "Deployment", f"{FULLNAME}-{component}")["spec"]["template"]["spec"]
        container = pod["containers"][0]
        ports = {port["name"] for port in container["ports"]}
        probes = {kind: container[f"{kind}Probe"] for kind in ("startup", "liveness", "readiness")}
        for kind, probe in probes.items():
            assert probe["httpGet"]["path"] in routes[component], (component, kind)
            assert probe["httpGet"]["port"] in ports
        assert probes["liveness"]["httpGet"]["path"] == "/healthz"
        assert probes["readiness"]["httpGet"]["path"] == "/readyz"


def test_the_backend_startup_probe_allows_for_model_loading() -> None:
    pod = _one(_docs("gpu"), "Deployment", f"{FULLNAME}-backend")["spec"]["template"]["spec"]
    probe = pod["containers"][0]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 600


@ALL
def test_no_secret_outside_a_secret(values: str) -> None:
    docs = _docs(values)
    secrets = _secret_values(docs)
    assert secrets or values == "existing-secret"
    credential = re.compile(r"SECRET|TOKEN|PASSWORD|API_KEY|ADMIN_KEY|DATABASE_URL|REDIS_URL")
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = yaml.safe_dump(doc)
        assert not any(secret in text for secret in secrets), doc["metadata"]["name"]
        if doc["kind"] == "ConfigMap":
            assert not [key for key in doc["data"] if credential.search(key)], doc["data"]
    for name, pod in _pod_specs(docs):
        for container in _containers(pod):
            for item in container.get("env", []):
                if credential.search(item["name"]):
                    assert "secretKeyRef" in item.get("valueFrom", {}), (name, item["name"])


def test_an_existing_secret_replaces_the_charts() -> None:
    docs = _docs("existing-secret")
    assert not [d for d in docs if d["kind"] == "Secret"]
    for _, pod in _pod_specs(docs):
        for container in _containers(pod):
            for item in container.get("env", []):
                if "valueFrom" in item:
                    assert item["valueFrom"]["secretKeyRef"]["name"] == "tollgate-prod"


# --- workloads ------------------------------------------------------------------------


@ALL
def test_beat_has_exactly_one_replica(values: str) -> None:
    docs = _docs(values)
    beat = _one(docs, "Deployment", f"{FULLNAME}-beat")
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"  # never two during a rollout
    scalers = [d for d in docs if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
    assert all(d["spec"]["scaleTargetRef"]["name"] != beat["metadata"]["name"] for d in scalers)


@ALL
def test_the_worker_pod_serves_the_billing_and_the_batch_queues_apart(values: str) -> None:
    """A batch run holds its worker slot for minutes: the relay's worker is another."""
    from gateway.settings import Settings

    docs = _docs(values)
    pod = _one(docs, "Deployment", f"{FULLNAME}-worker")["spec"]["template"]["spec"]
    queues = {c["name"]: c["args"][c["args"].index("-Q") + 1] for c in pod["containers"]}
    settings = Settings.from_env(_container_env(docs, pod["containers"][0]))
    assert queues == {"worker": settings.celery_queue, "batches": settings.celery_batch_queue}
    assert settings.celery_queue != settings.celery_batch_queue


@ALL
def test_every_container_requests_resources_and_runs_as_non_root(values: str) -> None:
    for name, pod in _pod_specs(_docs(values)):
        pod_context = pod.get("securityContext", {})
        for container in _containers(pod):
            requests = container["resources"]["requests"]
            assert "cpu" in requests and "memory" in requests, (name, container["name"])
            context = {**pod_context, **container.get("securityContext", {})}
            assert context.get("runAsNonRoot") is True, (name, container["name"])
            assert context.get("runAsUser", 0) != 0, (name, container["name"])
            assert context.get("allowPrivilegeEscalation") is False, (name, container["name"])


def test_gpu_backends_request_gpus_and_the_cuda_image() -> None:
    pod = _one(_docs("gpu"), "Deployment", f"{FULLNAME}-backend")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["image"].startswith("tollgate-backend-cuda:")
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    default = _one(_docs("defaults"), "Deployment", f"{FULLNAME}-backend")
    resources = default["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in resources.get("limits", {})


def test_backends_are_found_through_a_headless_service() -> None:
    from gateway.dispatch.discovery import RESOLVE_EVERY_S

    docs = _docs("defaults")
    service = _one(docs, "Service", f"{FULLNAME}-backend")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False  # draining pods drop out
    backend = _one(docs, "Deployment", f"{FULLNAME}-backend")
    labels = backend["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    # A rollout waits until every gateway has re-resolved the name before the next pod goes.
    assert backend["spec"]["minReadySeconds"] > RESOLVE_EVERY_S
    backends = _one(docs, "ConfigMap", f"{FULLNAME}-gateway")["data"]["TOLLGATE_BACKENDS"]
    assert backends == f"dns://{service['metadata']['name']}.{NAMESPACE}.svc:9000"


@WITH_BUDGETS
def test_grace_period_outlasts_prestop_drain_and_settling(values: str) -> None:
    from gateway.cli.drain import SETTLE_S

    docs = _docs(values)
    for component in ("gateway", "backend"):
        drain = int(_one(docs, "ConfigMap", f"{FULLNAME}-{component}")["data"]["TOLLGATE_DRAIN_S"])
        pod = _one(docs, "Deployment", f"{FULLNAME}-{component}")["spec"]["template"]["spec"]
        pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop > 0
        assert pod["terminationGracePeriodSeconds"] > pre_stop + drain + SETTLE_S


def test_migrations_run_as_a_hook_before_the_gateways() -> None:
    for values, first in (("defaults", "post-install"), ("external-databases", "pre-install")):
        docs = _docs(values)
        job = _one(docs, "Job", f"{FULLNAME}-migrate")
        hooks = job["metadata"]["annotations"]["helm.sh/hook"].split(",")
        assert hooks == [first, "pre-upgrade"]
        assert job["spec"]["template"]["spec"]["containers"][0]["args"] == ["db", "upgrade"]
        secret = [d for d in docs if d["kind"] == "Secret"]
        secret_weight = int(secret[0]["metadata"]["annotations"]["helm.sh/hook-weight"])
        assert secret_weight < int(job["metadata"]["annotations"]["helm.sh/hook-weight"])
        for component in ("gateway", "worker", "beat"):
            pod = _one(docs, "Deployment", f"{FULLNAME}-{component}")["spec"]["template"]["spec"]
            assert [c["name"] for c in pod["initContainers"]] == ["wait-for-schema"]


def test_bundled_databases_only_for_trials() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in _docs("defaults")}
    assert ("StatefulSet", f"{FULLNAME}-postgresql") in kinds
    assert ("Deployment", f"{FULLNAME}-redis") in kinds
    external = {d["metadata"]["name"] for d in _docs("external-databases")}
    assert f"{FULLNAME}-postgresql" not in external and f"{FULLNAME}-redis" not in external
    assert "trials" in _notes("defaults") and "trials" not in _notes("external-databases")


# --- scaling, disruption, network, monitoring -------------------------------------------


def test_gateways_scale_on_cpu_and_backends_on_engine_signals() -> None:
    docs = _docs("autoscaling")
    hpa = _one(docs, "HorizontalPodAutoscaler", f"{FULLNAME}-gateway")
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    scaled = _one(docs, "ScaledObject", f"{FULLNAME}-backend")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": f"{FULLNAME}-backend",
    }
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert all(t["type"] == "prometheus" for t in scaled["spec"]["triggers"])
    assert any("vllm:num_requests_waiting" in q for q in queries)
    assert any("vllm:kv_cache_usage_perc" in q for q in queries)
    assert all(f'service="{FULLNAME}-backend"' in query for query in queries)
    for trigger in scaled["spec"]["triggers"]:
        float(trigger["metadata"]["threshold"])  # KEDA wants a number in a string
        assert trigger["metadata"]["serverAddress"].startswith("http")
    backend = _one(docs, "Deployment", f"{FULLNAME}-backend")
    assert "replicas" not in backend["spec"]  # KEDA owns it
    assert not [d for d in _docs("defaults") if d["kind"] == "ScaledObject"]


@WITH_BUDGETS
def test_disruption_budgets_cover_the_serving_pods(values: str) -> None:
    docs = _docs(values)
    budgets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {f"{FULLNAME}-{c}" for c in ("gateway", "backend", "worker")}
    for name, budget in budgets.items():
        workload = _one(docs, "Deployment", name)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_backends_are_reachable_only_from_gateways_workers_and_monitoring() -> None:
    docs = _docs("defaults")
    policy = _one(docs, "NetworkPolicy", f"{FULLNAME}-backend")
    clients = [  # gateways, and Celery workers (batch lines)
        _one(docs, "Deployment", f"{FULLNAME}-{c}")["spec"]["template"]["metadata"]["labels"]
        for c in ("gateway", "worker")
    ]
    sources = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
    assert len(sources) == 3
    pods = [p["podSelector"]["matchLabels"] for p in sources if "podSelector" in p]
    assert len(pods) == 2
    for selector, labels in zip(pods, clients, strict=True):
        assert selector.items() <= labels.items()
    assert [p["app.kubernetes.io/component"] for p in pods] == ["gateway", "worker"]
    namespaces = [
        p["namespaceSelector"]["matchLabels"] for p in sources if "namespaceSelector" in p
    ]
    assert namespaces == [{"kubernetes.io/metadata.name": "monitoring"}]
    assert policy["spec"]["policyTypes"] == ["Ingress"]


def test_service_monitors_scrape_with_the_right_credentials() -> None:
    docs = _docs("autoscaling")
    secret = _one(docs, "Secret", FULLNAME)["stringData"]
    for component, key in (("gateway", "metrics-token"), ("backend", "backend-secret")):
        monitor = _one(docs, "ServiceMonitor", f"{FULLNAME}-{component}")
        service = _one(docs, "Service", f"{FULLNAME}-{component}")
        assert (
            monitor["spec"]["selector"]["matchLabels"].items()
            <= service["metadata"]["labels"].items()
        )
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
        assert endpoint["path"] == "/metrics" and "/metrics" in _routes()[component]
        credentials = endpoint["authorization"]["credentials"]
        assert credentials == {"name": FULLNAME, "key": key} and secret[key]


def test_switched_off_parts_are_gone_and_settings_pass_through() -> None:
    docs = _docs("toggles")
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler"}
    gateway = _one(docs, "Deployment", f"{FULLNAME}-gateway")
    assert gateway["spec"]["replicas"] == 2
    pod = gateway["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert "lifecycle" not in pod["containers"][0]
    config = _one(docs, "ConfigMap", f"{FULLNAME}-gateway")["data"]
    assert config["TOLLGATE_TRUSTED_PROXIES"] == "10.0.0.0/8"
    assert config["TOLLGATE_METRICS_TOP_TENANTS"] == "50"
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://otel-collector")
    secret = _one(docs, "Secret", FULLNAME)["stringData"]
    assert secret["admin-key"] == VALUE_SETS["toggles"]["secrets"]["adminKey"]


def test_notes_tell_how_to_get_the_first_admin_key() -> None:
    notes = _notes("defaults")
    assert f"kubectl -n {NAMESPACE} get secret {FULLNAME}" in notes
    assert "{.data.admin-key}" in notes
    assert "tollgate-prod" in _notes("existing-secret")
