"""Settings through pydantic-settings: precedence, file formats, and one line per bad field."""

from __future__ import annotations

import pydantic
import pytest

from kvevents.service.settings import DEFAULT_PORT, AggregatorSettings, EngineSpec, SettingsError, load_settings


def _errors(*args, **kwargs) -> list[str]:
    with pytest.raises(SettingsError) as info:
        load_settings(*args, **kwargs)
    return info.value.lines


def test_defaults_and_default_port_is_not_vllms():
    s = load_settings(None, env={})
    assert s.port == DEFAULT_PORT == 8090 and s.host == "127.0.0.1" and s.engines == ()
    assert s.stale_after_s == 30.0 and s.log_level == "info"


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_text('port = 9001\nhost = "127.0.0.2"\nstale_after_s = 5\n'
                   'engines = ["a=tcp://127.0.0.1:1"]\n')
    s = load_settings(str(cfg), env={})
    assert (s.port, s.host, s.stale_after_s, s.replay_timeout_s) == (9001, "127.0.0.2", 5.0, 2.0)
    s = load_settings(str(cfg), env={"KVEVENTS_PORT": "9002", "KVEVENTS_HOST": "127.0.0.3"})
    assert (s.port, s.host, s.stale_after_s) == (9002, "127.0.0.3", 5.0)
    s = load_settings(str(cfg), env={"KVEVENTS_PORT": "9002"}, port=9003, host=None)
    assert (s.port, s.host) == (9003, "127.0.0.2")  # None: flag not given
    # The config file can also come from the environment.
    assert load_settings(None, env={"KVEVENTS_CONFIG": str(cfg)}).port == 9001


def test_environment_names_new_and_legacy():
    env = {"KVEVENTS_ENGINES": "a=tcp://127.0.0.1:1; b=tcp://127.0.0.1:2,replay=tcp://127.0.0.1:3",
           "KVEVENTS_STALE_AFTER": "7", "KVEVENTS_REPLAY_TIMEOUT_S": "0.5",
           "KVEVENTS_MAX_BODY_BYTES": "4096", "KVEVENTS_LOG_LEVEL": "debug"}
    s = load_settings(None, env=env)
    assert [p.name for p in s.engines] == ["a", "b"] and s.engines[1].replay_endpoint == "tcp://127.0.0.1:3"
    assert (s.stale_after_s, s.replay_timeout_s, s.max_body_bytes, s.log_level) == (7.0, 0.5, 4096, "debug")
    assert [p.name for p in load_settings(None, env={"KVEVENTS_ENDPOINTS": "c=tcp://h:1"}).engines] == ["c"]
    # The field-named variable wins over the legacy one.
    assert load_settings(None, env={"KVEVENTS_STALE_AFTER": "7", "KVEVENTS_STALE_AFTER_S": "8"}).stale_after_s == 8
    assert load_settings(None, env={"KVEVENTS_PORT": ""}).port == DEFAULT_PORT  # empty: unset


def test_direct_construction_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("KVEVENTS_PORT", "9010")
    assert AggregatorSettings().port == 9010
    assert AggregatorSettings(port=9011).port == 9011


def test_engines_in_a_file_as_strings_or_tables(tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[[engines]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\n'
                   'replay_endpoint = "tcp://127.0.0.1:2"\nmodel = "m"\n\n'
                   '[[engines]]\nname = "b"\nendpoint = "tcp://*:3"\nbind = true\n')
    s = load_settings(str(cfg), env={})
    assert s.engines == (EngineSpec("a", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "m"),
                         EngineSpec("b", "tcp://*:3", bind=True))
    js = tmp_path / "kv.json"
    js.write_text('{"endpoints": ["a=tcp://127.0.0.1:1,model=m"], "port": 9005}')
    s = load_settings(str(js), env={})
    assert s.engines == (EngineSpec("a", "tcp://127.0.0.1:1", model="m"),) and s.port == 9005


def test_a_numeric_string_is_a_number_as_in_the_environment(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text('{"port": "8100"}')
    assert load_settings(str(cfg), env={}).port == 8100


@pytest.mark.parametrize("text, suffix, want", [
    ('{"port": "eighty"}', ".json", ["{f}: field 'port': Input should be a valid integer"]),
    ('{"port": 70000}', ".json", ["{f}: field 'port': Input should be less than or equal to 65535, got 70000 "
                                  "(expected: HTTP listen port, 1-65535)"]),
    ('{"prot": 8000}', ".json", ["{f}: field 'prot': unknown setting; known: engines, host, port"]),
    ('{"engines": [{"name": "a", "endpoint": "tcp://h:1", "replay": "tcp://h:2"}]}', ".json",
     ["{f}: field 'engines': entry 0: unknown key 'replay' (keys: name, endpoint, replay_endpoint"]),
    ('{"engines": [{"name": "a"}]}', ".json", ["{f}: field 'engines': entry 0: missing key 'endpoint'"]),
    ('{"engines": ["a=udp://h:1"]}', ".json", ["{f}: field 'engines': entry 0: "]),
    ('{"port": 8000,\n "host": }', ".json", ["{f}:2:10: invalid JSON: Expecting value"]),
    ('port = 8000\nhost = \n', ".toml", ["{f}: invalid TOML: Invalid value (at line 2, column 8)"]),
    ('[1, 2]', ".json", ["{f}: the top level must be an object/table of settings"]),
    ('{"port": 0, "stale_after_s": -1}', ".json",
     ["{f}: field 'port': Input should be greater than or equal to 1",
      "{f}: field 'stale_after_s': Input should be greater than 0"]),
])
def test_config_file_errors_name_file_field_and_fix(tmp_path, text, suffix, want):
    f = tmp_path / f"kvevents{suffix}"
    f.write_text(text)
    lines = _errors(str(f), env={})
    assert len(lines) == len(want), lines
    for line, prefix in zip(lines, want):
        assert line.startswith(prefix.format(f=f)), (line, prefix)
        assert "\n" not in line


def test_missing_file_environment_and_flag_errors(tmp_path):
    assert _errors(str(tmp_path / "nope.toml"), env={}) == [
        f"{tmp_path / 'nope.toml'}: cannot read the config file (No such file or directory)"]
    assert _errors(None, env={"KVEVENTS_PORT": "eighty"}) == [
        "environment variable KVEVENTS_PORT: Input should be a valid integer, unable to parse string "
        "as an integer, got 'eighty' (expected: HTTP listen port, 1-65535)"]
    assert _errors(None, env={"KVEVENTS_ENDPOINTS": "x"})[0].startswith(
        "environment variable KVEVENTS_ENDPOINTS: entry 0: expected NAME=tcp://HOST:PORT")
    assert _errors(None, env={}, port=0)[0].startswith("--port: Input should be greater than or equal to 1")
    assert _errors(None, env={}, engines=["a=tcp://h:1,replay"])[0].startswith(
        "--endpoint: entry 0: option 'replay' in 'a=tcp://h:1,replay' must be key=value")
    assert _errors(None, env={}, engines=["a=tcp://h:1", "a=tcp://h:2"]) == [
        "settings: engine names must be unique, got ['a', 'a']"]


def test_the_highest_source_is_blamed(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text('{"port": 1}')
    assert _errors(str(cfg), env={"KVEVENTS_PORT": "x"})[0].startswith("environment variable KVEVENTS_PORT")


def test_settings_are_immutable():
    s = load_settings(None, env={})
    with pytest.raises(pydantic.ValidationError):
        s.port = 1  # type: ignore[misc]


def test_the_documented_config_example_loads(tmp_path):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "engines.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", page, re.S)
    assert blocks, "docs/engines.md shows a TOML config file"
    for i, block in enumerate(blocks):
        f = tmp_path / f"readme{i}.toml"
        f.write_text(block)
        s = load_settings(str(f), env={})
        assert s.port == 8090 and s.engines


def test_old_pod_names_still_load(tmp_path):
    """Engines were called pods: config files, variables and keyword arguments that
    still say so keep working, and errors name the key the user wrote."""
    cfg = tmp_path / "old.toml"
    cfg.write_text('max_pods = 3\n[[pods]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\n')
    s = load_settings(str(cfg), env={})
    assert s.engines == (EngineSpec("a", "tcp://127.0.0.1:1"),) and s.max_engines == 3
    s = load_settings(None, env={"KVEVENTS_PODS": "b=tcp://127.0.0.1:2", "KVEVENTS_MAX_PODS": "5"})
    assert [e.name for e in s.engines] == ["b"] and s.max_engines == 5
    # The new variable wins over the old one.
    s = load_settings(None, env={"KVEVENTS_PODS": "b=tcp://127.0.0.1:2",
                                 "KVEVENTS_ENGINES": "c=tcp://127.0.0.1:3"})
    assert [e.name for e in s.engines] == ["c"]
    assert AggregatorSettings(pods=("d=tcp://127.0.0.1:4",)).engines[0].name == "d"
    bad = tmp_path / "bad.json"
    bad.write_text('{"pods": [{"name": "a"}]}')
    assert _errors(str(bad), env={}) == [f"{bad}: field 'pods': entry 0: missing key 'endpoint'"]
    assert _errors(None, env={"KVEVENTS_MAX_PODS": "-1"})[0].startswith(
        "environment variable KVEVENTS_MAX_PODS: ")


def test_podspec_is_a_deprecated_alias_of_enginespec():
    from kvevents.service.settings import PodSpec

    assert PodSpec is EngineSpec
    assert PodSpec.parse("a=tcp://127.0.0.1:1") == EngineSpec("a", "tcp://127.0.0.1:1")
