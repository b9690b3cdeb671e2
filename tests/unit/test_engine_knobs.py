"""Every EngineConfig field is a flag of `tollgate serve` and `tollgate backend serve` (run
through the command's entry point, gateway/cli/__init__.py, as a user runs them), an
environment variable and a README row; bad values exit 2 with one line."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from backend.builtin import BUILTIN_MODEL_DIR
from backend.config import EngineConfig
from gateway import cli as launch
from gateway.cli import commands as cli
from gateway.settings import Settings, SettingsError, engine_knobs
from gateway.settings.engine_knobs import Knob, knobs, parse_size

README = Path(__file__).resolve().parents[2] / "README.md"
COMMANDS = (["serve"], ["backend", "serve"])
# Valid values of the text fields, which the generic rules below cannot invent.
TEXT_SAMPLES = {
    "dtype": "float16",
    "device": "cpu",
    "attention_backend": "torch",
    "quantization": "int8",
    "kv_cache_dtype": "int8",
    "speculative_method": "ngram",
    "async_scheduling": "on",
    "speculative_model": str(BUILTIN_MODEL_DIR),  # a checkpoint folder that exists
}
# Numbers whose half of the default is out of range.
NUMBER_SAMPLES = {"filler_slowdown": 2.0}  # a slowdown >= 1


def _subparser(path: list[str]) -> argparse.ArgumentParser:
    parser = cli._parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _sample(knob: Knob) -> tuple[str, object]:
    """A valid value for the knob that differs from the defaults, as text and parsed."""
    default = getattr(Settings.from_env({}).engine, knob.name)
    if knob.kind is bool:
        return str(not default).lower(), not default
    if knob.kind is int:
        value = 7 if default in (None, 7) else default + 1  # type: ignore[operator]
        return str(value), value
    if knob.kind is float:
        value = NUMBER_SAMPLES.get(knob.name, 0.125 if default is None else default / 2)
        return str(value), value
    assert knob.name in TEXT_SAMPLES, f"add a valid sample value of {knob.name} to TEXT_SAMPLES"
    return TEXT_SAMPLES[knob.name], TEXT_SAMPLES[knob.name]


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """The settings `tollgate serve` / `backend serve` would start with; nothing starts."""
    import gateway.cli.serve

    calls: list[Settings] = []

    def record(settings: Settings) -> int:
        calls.append(settings)
        return 0

    for name in ("serve", "serve_backend"):
        monkeypatch.setattr(gateway.cli.serve, name, record)
    for knob in knobs():
        monkeypatch.delenv(knob.env, raising=False)
    monkeypatch.delenv("TOLLGATE_ENGINE_THREADS", raising=False)
    return calls


def test_every_field_has_a_flag_a_variable_and_a_readme_row() -> None:
    names = [f.name for f in fields(EngineConfig)]
    assert [k.name for k in knobs()] == names
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `--")]
    for path in COMMANDS:
        options = {o for a in _subparser(path)._actions for o in a.option_strings}
        missing = [k.flag for k in knobs() if k.flag not in options]
        assert not missing, f"tollgate {' '.join(path)} lacks {missing}"
    for knob in knobs():
        assert knob.env == "TOLLGATE_" + knob.flag[2:].replace("-", "_").upper()
        assert any(f"`{knob.flag}`" in row and f"`{knob.env}`" in row for row in rows), (
            f"README.md has no engine-knob row for {knob.flag} / {knob.env}"
        )


@pytest.mark.parametrize("knob", knobs(), ids=lambda k: k.name)
def test_each_flag_and_variable_reaches_the_engine(knob: Knob, started: list[Settings]) -> None:
    text, value = _sample(knob)
    assert getattr(Settings.from_env({knob.env: text}).engine, knob.name) == value
    args = [knob.flag if value else f"--no-{knob.flag[2:]}"] if knob.kind is bool else []
    for path in COMMANDS:
        given = args or [knob.flag, text]
        assert launch.main([*path, *given]) == 0
        assert getattr(started.pop().engine, knob.name) == value


@pytest.mark.parametrize("knob", knobs(), ids=lambda k: k.name)
def test_a_bad_value_exits_2_with_one_line_naming_flag_and_variable(
    knob: Knob,
    started: list[Settings],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = {int: "x1", float: "fast", bool: "maybe", str: "not a value"}[knob.kind]
    attempts: list[list[str]] = [[*path, knob.flag, bad] for path in COMMANDS]
    if knob.kind is bool:  # a boolean flag takes no value; only its variable can be bad
        attempts = [list(path) for path in COMMANDS]
        monkeypatch.setenv(knob.env, bad)
    for argv in attempts:
        assert launch.main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and knob.flag in lines[0] and knob.env in lines[0], lines
    assert started == []  # nothing started


def test_knobs_checked_together_are_set_together(started: list[Settings]) -> None:
    """--speculative-method draft needs --speculative-model: given both, variables or
    flags, the engine gets both (one at a time, the first failed on its own)."""
    draft = str(BUILTIN_MODEL_DIR)
    both = {"TOLLGATE_SPECULATIVE_METHOD": "draft", "TOLLGATE_SPECULATIVE_MODEL": draft}
    engine = Settings.from_env(both).engine
    assert (engine.speculative_method, engine.speculative_model) == ("draft", draft)
    flags = ["--speculative-method", "draft", "--speculative-model", draft]
    assert launch.main(["serve", *flags]) == 0
    engine = started.pop().engine
    assert (engine.speculative_method, engine.speculative_model) == ("draft", draft)
    with pytest.raises(SettingsError, match="--speculative-method / TOLLGATE_SPECULATIVE_METHOD"):
        Settings.from_env({"TOLLGATE_SPECULATIVE_METHOD": "draft"})


def test_a_bad_variable_names_itself_in_settings() -> None:
    with pytest.raises(SettingsError, match="--max-num-seqs / TOLLGATE_MAX_NUM_SEQS"):
        Settings.from_env({"TOLLGATE_MAX_NUM_SEQS": "0"})


def test_flag_beats_variable_beats_default(
    started: list[Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert launch.main(["serve"]) == 0
    engine = started.pop().engine
    assert (engine.max_num_seqs, engine.device, engine.enable_prefix_caching) == (
        None,
        "auto",
        True,
    )
    assert engine.on_device("cpu").max_num_seqs == 32  # None: by the device the engine takes
    assert engine.on_device("cuda").max_num_seqs == 256
    monkeypatch.setenv("TOLLGATE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("TOLLGATE_ENABLE_PREFIX_CACHING", "on")
    assert launch.main(["backend", "serve"]) == 0
    assert started.pop().engine.max_num_seqs == 8
    assert launch.main(["serve", "--max-num-seqs", "4", "--no-enable-prefix-caching"]) == 0
    engine = started.pop().engine
    assert (engine.max_num_seqs, engine.enable_prefix_caching) == (4, False)


def test_sizes_none_and_the_old_thread_variable(started: list[Settings]) -> None:
    argv = ["serve", "--kv-cache-bytes", "4GiB", "--max-model-len", "none", "--device", "cuda:1"]
    assert launch.main(argv) == 0
    engine = started.pop().engine
    assert engine.kv_cache_bytes == 4 * 2**30
    assert (engine.max_model_len, engine.device) == (None, "cuda:1")
    assert Settings.from_env({"TOLLGATE_ENGINE_THREADS": "3"}).engine.cpu_threads == 3
    both = {"TOLLGATE_ENGINE_THREADS": "3", "TOLLGATE_CPU_THREADS": "5"}
    assert Settings.from_env(both).engine.cpu_threads == 5


@pytest.mark.parametrize(
    ("text", "size"),
    [("268435456", 2**28), ("512MiB", 2**29), ("4GiB", 2**32), ("4g", 2**32), ("1.5KB", 1536)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "4 GiBs", "1.3B", "-1", "GiB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_an_unflaggable_field_type_is_an_error() -> None:
    with pytest.raises(TypeError, match=r"EngineConfig\.x"):
        engine_knobs._knob("x", list[int], None)


def test_fp8_weights_without_an_fp8_gpu_exit_2_before_anything_starts(
    started: list[Settings],
) -> None:
    """Issue 34: fp8 needs compute capability 8.9+; on this machine (no GPU) both commands
    refuse it with one line, before the engine loads (checked in gateway.cli.serve)."""
    import gateway.cli.serve

    for path in COMMANDS:
        settings = Settings.from_env({"TOLLGATE_QUANTIZATION": "fp8", "TOLLGATE_DEVICE": "cpu"})
        with pytest.raises(engine_knobs.KnobError, match="fp8 needs a GPU"):
            gateway.cli.serve.check_engine_device(settings)
        assert launch.main([*path, "--quantization", "fp8"]) == 0  # parsing accepts it
    assert [s.engine.quantization for s in started] == ["fp8", "fp8"]
