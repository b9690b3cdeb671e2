from __future__ import annotations

from pathlib import Path

import pytest

from gateway.settings import Settings, SettingsError


def test_defaults_are_the_embedded_mode() -> None:
    settings = Settings.from_env({})
    assert settings.database_url == "sqlite:///.tollgate/tollgate.db"
    assert settings.redis_url is None
    assert settings.model_path is None
    assert (settings.host, settings.port) == ("127.0.0.1", 8000)


def test_environment_overrides() -> None:
    settings = Settings.from_env(
        {
            "TOLLGATE_DATABASE_URL": "postgresql://u@127.0.0.1/db",
            "TOLLGATE_REDIS_URL": "redis://127.0.0.1:6379/0",
            "TOLLGATE_MODEL": "/models/llama",
            "TOLLGATE_HOST": "0.0.0.0",
            "TOLLGATE_PORT": "9000",
            "TOLLGATE_DATA_DIR": "/var/lib/tollgate",
        }
    )
    assert settings.database_url == "postgresql://u@127.0.0.1/db"
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.model_path == Path("/models/llama")
    assert settings.port == 9000
    assert settings.admin_key_file == Path("/var/lib/tollgate/admin-key")


@pytest.mark.parametrize(("value", "fragment"), [("x", "integer"), ("70000", "between")])
def test_bad_port_names_the_variable(value: str, fragment: str) -> None:
    with pytest.raises(SettingsError, match="TOLLGATE_PORT") as info:
        Settings.from_env({"TOLLGATE_PORT": value})
    assert fragment in str(info.value)


def test_flags_override_only_what_is_given() -> None:
    settings = Settings.from_env({"TOLLGATE_PORT": "9000"})
    changed = settings.with_overrides(host="0.0.0.0", port=None)
    assert (changed.host, changed.port) == ("0.0.0.0", 9000)


def test_trusted_proxies_are_ips_or_cidr_blocks() -> None:
    assert Settings.from_env({}).trusted_proxies == ()  # no proxy unless one is named
    given = {"TOLLGATE_TRUSTED_PROXIES": " 10.0.0.0/8, fd00::/8 ,192.168.1.7"}
    assert Settings.from_env(given).trusted_proxies == ("10.0.0.0/8", "fd00::/8", "192.168.1.7")
    assert Settings.from_env({"TOLLGATE_TRUSTED_PROXIES": ""}).trusted_proxies == ()
    assert Settings.from_env({"TOLLGATE_TRUSTED_PROXIES": "*"}).trusted_proxies == ("*",)
    with pytest.raises(SettingsError, match=r"TOLLGATE_TRUSTED_PROXIES: 'proxy\.internal'"):
        Settings.from_env({"TOLLGATE_TRUSTED_PROXIES": "10.0.0.1,proxy.internal"})


def test_the_admin_password_is_a_setting_kept_out_of_repr() -> None:
    settings = Settings.from_env({"TOLLGATE_ADMIN_PASSWORD": "hunter2 hunter2"})
    assert settings.admin_password == "hunter2 hunter2"
    assert "hunter2" not in repr(settings)
    assert Settings.from_env({"TOLLGATE_ADMIN_PASSWORD": ""}).admin_password is None


def test_upstream_priority_models_name_their_convention() -> None:
    given = {"TOLLGATE_UPSTREAM_PRIORITY_MODELS": "a, b:higher-first ,c:lower-first"}
    orders = Settings.from_env(given).upstream_priority_models
    assert orders == {"a": "lower-first", "b": "higher-first", "c": "lower-first"}
    shared = {"TOLLGATE_UPSTREAM_SHARED_CACHE_MODELS": "a,,b "}
    assert Settings.from_env(shared).upstream_shared_cache_models == {"a", "b"}
    with pytest.raises(SettingsError, match=r"TOLLGATE_UPSTREAM_PRIORITY_MODELS: 'b:first'"):
        Settings.from_env({"TOLLGATE_UPSTREAM_PRIORITY_MODELS": "a,b:first"})


def test_the_s3_file_store_is_chosen_by_its_bucket() -> None:
    assert Settings.from_env({}).s3 is None
    settings = Settings.from_env(
        {
            "TOLLGATE_S3_BUCKET": "tollgate-files",
            "TOLLGATE_S3_ENDPOINT_URL": "http://minio:9000/",
            "TOLLGATE_S3_PREFIX": "prod",
            "TOLLGATE_S3_ACCESS_KEY_ID": "id",
            "TOLLGATE_S3_SECRET_ACCESS_KEY": "hush-hush",
        }
    )
    assert settings.s3 is not None
    assert (settings.s3.bucket, settings.s3.endpoint_url) == ("tollgate-files", "http://minio:9000")
    assert (settings.s3.prefix, settings.s3.region) == ("prod/", "us-east-1")
    assert "hush-hush" not in repr(settings)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"TOLLGATE_S3_ENDPOINT_URL": "http://minio:9000"}, "without TOLLGATE_S3_BUCKET"),
        ({"TOLLGATE_S3_BUCKET": "b", "TOLLGATE_S3_ACCESS_KEY_ID": "id"}, "go together"),
    ],
)
def test_half_an_s3_setting_is_refused(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(SettingsError, match=fragment):
        Settings.from_env(env)
