"""Knobs removed after their measurement showed no gain (protocol/removed.py, issue 53): an old config,
value or environment that still sets one is refused naming it and what runs instead, never ignored."""
from __future__ import annotations

import json
import subprocess

import pytest
from pydantic import ValidationError

from pdrollout.engine.protocol.config import EngineConfig
from pdrollout.engine.protocol.exits import EXIT_CONFIG
from pdrollout.engine.protocol.removed import REMOVED_ENV, REMOVED_FIELDS, REMOVED_VALUES
from serverproc import SERVE

OLD_SETTINGS = {"dense_kernel": "skinny", "p_sms": 32, "switch_interval_ms": 0.2}


@pytest.mark.parametrize("name", sorted(REMOVED_FIELDS))
def test_a_removed_field_is_refused_naming_it_and_what_runs_instead(name):
    assert name not in EngineConfig.model_fields
    with pytest.raises(ValidationError) as e:
        EngineConfig(model="m", **{name: OLD_SETTINGS[name]})
    assert f"{name} was removed" in str(e.value) and REMOVED_FIELDS[name] in str(e.value)


def test_a_removed_value_is_refused_and_the_kept_ones_still_run():
    (name, values), = REMOVED_VALUES.items()
    for v, instead in values.items():
        with pytest.raises(ValidationError) as e:
            EngineConfig(model="m", **{name: v})
        assert f"{name}={v!r} was removed" in str(e.value) and instead in str(e.value)
    assert EngineConfig(model="m", priority_stream="d").priority_stream_on(multi=True) == "d"
    assert EngineConfig(model="m", priority_stream="none").priority_stream_on(multi=False) is None


@pytest.mark.parametrize("name", sorted(REMOVED_ENV))
def test_a_removed_environment_variable_is_refused_while_set(monkeypatch, name):
    EngineConfig(model="m")
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValidationError, match=f"environment variable {name} was removed"):
        EngineConfig(model="m")


def test_serve_with_an_old_config_file_exits_as_a_config_error_naming_the_knob(tiny_model, tmp_path):
    """The --engine-config file of an earlier run: refused before listening, with the config exit code."""
    old = tmp_path / "engine.json"
    old.write_text(json.dumps({"max_running": 8, "p_sms": 32}))
    r = subprocess.run([*SERVE, "--model", str(tiny_model), "--port", "0", "--engine-config", str(old)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_CONFIG and "p_sms was removed" in r.stderr, r.stderr
    assert "ready on" not in r.stdout
