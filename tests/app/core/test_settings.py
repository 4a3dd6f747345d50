"""Settings: defaults < YAML < environment < flags; every shipped config file loads; mistakes are loud."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.cli.commands import build_parser
from app.cli.serve import settings_from_args
from app.core.settings import SettingsInputError, Settings, load_settings

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("WM_REFINER_"):
            monkeypatch.delenv(name)


def test_precedence_flags_over_env_over_yaml_over_defaults(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9001\nmax_sessions: 3\ndefault_block_size: 2\ndevice: cpu\n")
    monkeypatch.setenv("WM_REFINER_MAX_SESSIONS", "5")
    monkeypatch.setenv("WM_REFINER_DEVICE", "cuda")
    monkeypatch.setenv("WM_REFINER_DEFAULT_SIGMAS", "[0.9, 0.5, 0.0]")
    settings = load_settings(config, device="cpu", host=None)
    assert settings.port == 9001  # YAML over the default
    assert settings.max_sessions == 5  # environment over YAML
    assert settings.device == "cpu"  # flag over environment
    assert settings.host == "127.0.0.1"  # an unset flag falls through
    assert settings.default_block_size == 2
    assert settings.default_sigmas == (0.9, 0.5, 0.0)
    assert type(settings) is Settings


def test_cli_flags_reach_the_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("WM_REFINER_PORT", "7000")
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--api-key", "key-0451", "--dtype", "float32"])
    settings = settings_from_args(args)
    assert (settings.model, settings.api_key, settings.dtype, settings.port) == (str(tmp_path), "key-0451", "float32", 7000)
    assert "key-0451" not in repr(settings), "the API key is kept out of logs"


def test_config_file_from_the_environment(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("max_frames_per_chunk: 7\n")
    monkeypatch.setenv("WM_REFINER_CONFIG", str(config))
    assert load_settings().max_frames_per_chunk == 7


@pytest.mark.parametrize("name", ["default.yaml", "sana-wm.yaml", "bench.yaml"])
def test_shipped_configs_load(name):
    settings = load_settings(CONFIGS / name)
    settings.session_defaults()
    if name == "sana-wm.yaml":
        assert (settings.device, settings.dtype) == ("cuda", "bfloat16")
        assert (settings.warmup_height, settings.warmup_width) == (22, 40)
        assert settings.compile_geometries() == [(22, 40), (15, 26)]  # 720p and 480p compiled before /ready
        # The production preset keeps the README's bit-identity (retries, restores, adoptions): batching only where
        # the probe passed (`true` warned at every start that bytes may depend on neighbours).
        assert settings.batching == "auto"
    if name == "default.yaml":
        assert settings.model is None and settings.device == "cpu"


def test_mistakes_are_loud(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("max_sesions: 3\n")
    with pytest.raises(SettingsInputError, match=r"^max_sesions in .*typo.yaml: no such setting \(did you mean "
                                                 r"max_sessions\?\)$"):
        load_settings(typo)
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "missing.yaml")
    with pytest.raises(ValidationError, match="kv_max_frames"):
        Settings(default_kv_max_frames=2)
    with pytest.raises(ValidationError):
        Settings(max_sessions=0)


def test_compile_buckets_and_warmup_geometries_from_yaml_and_the_environment(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("warmup_geometries: [15x26, [22, 40]]\ncompile_buckets: [1, 3]\nwarmup_height: 8\n")
    settings = load_settings(config)
    assert settings.warmup_geometries == ((15, 26), (22, 40)) and settings.compile_buckets == (1, 3)
    assert settings.compile_geometries() == [(8, 4), (15, 26), (22, 40)]  # the warm-up stream's size first
    assert Settings().compile_buckets == "every" and Settings().compile_geometries() == [(4, 4)]
    monkeypatch.setenv("WM_REFINER_WARMUP_GEOMETRIES", "8x4, 2x6")
    monkeypatch.setenv("WM_REFINER_COMPILE_BUCKETS", "powers")
    settings = load_settings(config)
    assert settings.compile_geometries() == [(8, 4), (2, 6)] and settings.compile_buckets == "powers"


@pytest.mark.parametrize("values, message", [
    (dict(warmup_geometries="15by26"), "write height x width, e.g. 15x26"),
    (dict(warmup_geometries=[[15, 0]]), "must be positive"),
    (dict(compile_buckets="all"), "every, powers, or batch sizes like 1,2,3,4"),
    (dict(compile_buckets="1,12", max_batch_rows=8), r"no call has more than max_batch_rows \(8\) rows"),
    (dict(compile_buckets=""), "compile_buckets is empty"),
    (dict(warmup_geometries=[[15.9, 26]]), "is not a latent size"),
    (dict(warmup_geometries="200x200", max_frame_tokens=4096), "past max_frame_tokens"),
])
def test_compile_settings_mistakes_say_what_to_send(values, message):
    with pytest.raises(ValidationError, match=message):
        Settings(**values)


def test_every_setting_is_documented():
    doc = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text()
    for name in Settings.model_fields:
        assert f"`WM_REFINER_{name.upper()}`" in doc, f"docs/operations.md does not list {name}"


def test_a_value_given_wrong_names_its_setting_and_where_it_came_from(tmp_path, monkeypatch):
    """One line per mistake, whichever layer it came from (flag, variable, file), with pydantic's reason or a hint."""
    config = tmp_path / "c.yaml"
    config.write_text("max_sessions: 0\n")
    with pytest.raises(SettingsInputError, match=r"^max_sessions in .*c.yaml=0: Input should be greater than 0$"):
        load_settings(config)
    with pytest.raises(SettingsInputError, match=r"^--port='http': Input should be a valid integer"):
        load_settings(port="http")
    monkeypatch.setenv("WM_REFINER_MAX_SESSIONS", "lots")
    monkeypatch.setenv("WM_REFINER_PORT", "-1")
    with pytest.raises(SettingsInputError) as raised:
        load_settings()
    assert "$WM_REFINER_MAX_SESSIONS='lots': Input should be a valid integer" in str(raised.value)
    assert "\n" not in str(raised.value)
    monkeypatch.delenv("WM_REFINER_MAX_SESSIONS")
    monkeypatch.delenv("WM_REFINER_PORT")
    monkeypatch.setenv("WM_REFINER_DEFAULT_SIGMAS", "0.9,0.5,0.0")
    with pytest.raises(SettingsInputError, match=r"takes JSON \(a list as \[0.9, 0.5, 0.0\]"):
        load_settings()
    monkeypatch.setenv("WM_REFINER_DEFAULT_SIGMAS", "[0.9, 0.5, 0.0]")
    assert load_settings().default_sigmas == (0.9, 0.5, 0.0)


def test_a_variable_that_names_no_setting_is_warned_about():
    from app.cli.serve import unknown_variables

    warnings = unknown_variables({"WM_REFINER_MAX_SESION": "3", "WM_REFINER_PORT": "1", "WM_REFINER_URL": "x",
                                  "WM_REFINER_CONFIG": "c.yaml", "WM_REFINER_ZZZ_QQQ": "1", "HOME": "/"})
    assert warnings == ["$WM_REFINER_MAX_SESION is not a setting and is ignored (did you mean "
                        "$WM_REFINER_MAX_SESSIONS?)",
                        "$WM_REFINER_ZZZ_QQQ is not a setting and is ignored (docs/operations.md lists every setting)"]


def test_a_settings_file_that_is_not_yaml_is_one_line_naming_the_file_and_the_line(tmp_path):
    """A syntax error said like every other mistake in the file (a new user's: "error (ScannerError): ... in
    '<unicode string>'", naming neither the file nor the fix)."""
    config = tmp_path / "c.yaml"
    config.write_text("max_sessions: 4\nport: 80: 80\n")
    with pytest.raises(SettingsInputError, match=r"c\.yaml: not valid YAML \(mapping values are not allowed here at "
                                                 r"line 2, column 9\); write one `setting: value` per line"):
        load_settings(config)
    config.write_text("- max_sessions\n")
    with pytest.raises(SettingsInputError, match=r"c\.yaml: a settings file must be a mapping of setting: value"):
        load_settings(config)
