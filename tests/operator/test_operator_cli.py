"""`python -m pdrollout.operator` refuses to start without what the engines' admin tokens need, saying so
(before kopf starts and before any rollout would fail on it)."""
import subprocess
import sys

import pytest


def start(tmp_path, **env):
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PDROLLOUT_OPERATOR_NAMESPACE": "ops"}
    return subprocess.run([sys.executable, "-m", "pdrollout.operator"], capture_output=True, text=True,
                          timeout=120, env={**base, **env})


@pytest.mark.parametrize("key, why", [
    (None, "PDROLLOUT_OPERATOR_TOKEN_KEY_FILE (or --token-key-file) is required"),
    (b"short", "holds 5 bytes; at least 32 are needed"),
    ("missing", "No such file or directory"),
])
def test_operator_needs_a_token_key(tmp_path, key, why):
    env = {}
    if key is not None:
        path = tmp_path / "key"
        if isinstance(key, bytes):
            path.write_bytes(key)
        env["PDROLLOUT_OPERATOR_TOKEN_KEY_FILE"] = str(path)
    r = start(tmp_path, **env)
    assert r.returncode == 2 and why in r.stderr, r.stderr


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan"])
def test_bad_poll_seconds_is_a_clear_error(tmp_path, value):
    """What `--set operator.pollSeconds=abc` did before the chart's schema: now also refused by the
    operator itself, with the variable named, instead of a traceback."""
    (tmp_path / "key").write_bytes(b"k" * 32)
    r = start(tmp_path, PDROLLOUT_OPERATOR_TOKEN_KEY_FILE=str(tmp_path / "key"), PDROLLOUT_OPERATOR_POLL_S=value)
    assert r.returncode == 1 and f"PDROLLOUT_OPERATOR_POLL_S={value!r} must be a positive number" in r.stderr, \
        r.stderr
    assert "Traceback" not in r.stderr
