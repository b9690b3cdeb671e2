"""The wheel the images are built from: installed into a fresh virtual environment (not
editable, no source tree on the path), `tollgate serve` answers a chat request with the
built-in model and serves the console's templates and static files.

The new environment sees this one's site-packages through a .pth line, so torch and the
other dependencies are not installed again; the .pth files of that directory (the
editable install of the source tree among them) are not processed, and the wheel's own
packages come first on the path.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.processes import free_port, running
from tests.infra.conftest import spawn

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "gateway", "backend", "tenants", "migrations", "web")
BUILD_TIMEOUT_S = 240


def _copy_sources(destination: Path) -> Path:
    """The files the wheel is built from, away from the work tree (setuptools writes
    build/ and *.egg-info next to its input)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    destination.mkdir(parents=True)
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, destination / name, ignore=ignore)
        else:
            shutil.copy2(source, destination / name)
    return destination


def _build_wheel(sources: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(out), str(sources)],
        check=True, capture_output=True, timeout=BUILD_TIMEOUT_S,
    )  # fmt: skip
    (wheel,) = out.glob("tollgate-*.whl")
    return wheel


def _fresh_venv(path: Path, wheel: Path) -> Path:
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "shared-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=BUILD_TIMEOUT_S,
    )  # fmt: skip
    return path / "bin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ folder of a fresh environment holding the built wheel."""
    work = tmp_path_factory.mktemp("wheel")
    sources = _copy_sources(work / "src")
    wheel = _build_wheel(sources, work / "dist")
    shutil.rmtree(sources)  # nothing may be read from the copy once installed
    return _fresh_venv(work / "venv", wheel)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env.pop("PYTHONPATH", None)  # the source tree must not shadow the wheel
    return env


def test_the_wheel_ships_code_model_and_console(installed: Path, tmp_path: Path) -> None:
    probe = (
        "import gateway, backend.builtin, web, migrations;"
        "print(gateway.__file__); print(backend.builtin.BUILTIN_MODEL_DIR)"
    )
    lines = subprocess.run(
        [str(installed / "python"), "-c", probe],
        check=True, capture_output=True, text=True, cwd=tmp_path, env=_clean_env(),
    ).stdout.split()  # fmt: skip
    site_dir = str(installed.parent / "lib")
    assert all(line.startswith(site_dir) for line in lines), lines
    model_dir = Path(lines[1])
    assert (model_dir / "model.safetensors").stat().st_size > 0
    assert (model_dir / "tokenizer.json").is_file()


@dataclass
class Served:
    base_url: str
    admin_key: str
    model: str


@pytest.fixture(scope="module")
def served(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    data_dir = tmp_path_factory.mktemp("wheel-serve")
    port = free_port()
    env = {**_clean_env(), "TOLLGATE_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    process = spawn([str(installed / "tollgate"), "serve", "--port", str(port)], env, data_dir)
    with running(process):
        banner = process.wait_for('"model"')  # the banner's last line, printed once listening
        admin_key = re.search(r"Admin key \(new\): (tg-\S+)", banner)
        model = re.search(r'"model": "([^"]+)"', banner)
        assert admin_key and model, banner
        yield Served(f"http://127.0.0.1:{port}", admin_key.group(1), model.group(1))


def test_serve_from_the_wheel_answers_chat(served: Served) -> None:
    response = httpx.post(
        f"{served.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {served.admin_key}"},
        json={
            "model": served.model,
            "messages": [{"role": "user", "content": "What does json.dumps do?"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] > 0


def test_serve_from_the_wheel_serves_the_console(served: Served) -> None:
    login = httpx.get(f"{served.base_url}/admin/login", timeout=10)
    assert login.status_code == 200
    assert "<form" in login.text and 'type="password"' in login.text
    css = httpx.get(f"{served.base_url}/admin/static/console.css", timeout=10)
    assert css.status_code == 200
    assert css.text == (ROOT / "web" / "static" / "console.css").read_text(encoding="utf-8")
