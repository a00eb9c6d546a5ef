"""One configuration path from Python: settings reach the same keys from the
environment and from ``settings=``; a bad value raises FerryError with the
reason; and ``ferry.info()`` is the report ``ferry info --json`` gives (the
CLI and C are compared in tests/config.rs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ferry
from conftest import env_without_ferry_vars

REPO = Path(__file__).resolve().parents[2]


def run_py(code, **env):
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, env=env_without_ferry_vars(**env), cwd="/",
    )
    return out


def test_settings_and_variables_reach_the_same_keys(tmp_path):
    given = {
        "gpu_direct": "off",
        "staging_chunk": "16M",
        "staging_depth": "8",
        "timeout_ms": "250",
        "transports": "^rdma",
        "sysfs_root": str(tmp_path),
        "auth_token": "s3cret",
    }
    by_settings = run_py("import ferry, json; print(json.dumps(ferry.config(%r)))" % (given,))
    assert by_settings.returncode == 0, by_settings.stderr
    by_env = run_py(
        "import ferry, json; print(json.dumps(ferry.config()))",
        **{"FERRY_" + k.upper(): v for k, v in given.items()},
    )
    assert by_env.returncode == 0, by_env.stderr
    a, b = json.loads(by_settings.stdout), json.loads(by_env.stdout)
    assert a == b
    assert a["staging_chunk"] == str(16 << 20)
    assert a["gpu_direct"] == "off"
    assert a["auth_token"] == "(set)"  # never the secret


@pytest.mark.parametrize(
    "key, bad",
    [("gpu_direct", "yes"), ("staging_chunk", "1K"), ("staging_depth", 17), ("timeout_ms", "soon")],
)
def test_bad_values_raise_with_the_reason(key, bad):
    with pytest.raises(ferry.FerryError) as e:
        ferry.config({key: bad})
    assert e.value.name == "INVALID_ARGUMENT"
    assert f"setting {key} = \"{bad}\" rejected" in e.value.message
    # An engine refuses the same value the same way, before starting.
    with pytest.raises(ferry.FerryError) as e:
        ferry.Engine(settings={key: bad})
    assert e.value.name == "INVALID_ARGUMENT"
    # And from the environment, naming the variable.
    var = "FERRY_" + key.upper()
    out = run_py("import ferry; ferry.config()", **{var: str(bad)})
    assert out.returncode != 0
    assert var in out.stderr and "INVALID_ARGUMENT" in out.stderr


def test_unknown_keys_are_refused():
    with pytest.raises(ferry.FerryError) as e:
        ferry.config({"colour": "blue"})
    assert e.value.name == "INVALID_ARGUMENT" and "unknown option" in e.value.message
    assert ferry.config({"tcp.connections": 3})["tcp.connections"] == "3"


def ferry_cli():
    given = os.environ.get("FERRY_CLI")
    path = Path(given) if given else REPO / "target" / "debug" / "ferry"
    if not path.exists():
        pytest.skip(f"no ferry binary at {path} (cargo build -p ferry-cli, or set FERRY_CLI)")
    return path


def normalized(report):
    """What does not depend on where the caller's binary lives: the wheel's
    module finds plugins in the package, the CLI in the build tree, so
    search paths, plugin files, the helper's path and timings differ, and
    so does what a probe measured (shm declares a bandwidth from a memcpy
    at probe time, stated in the device's detail); everything else
    (settings, each plugin's state, reason, capabilities, devices, GPUs,
    the GPU-direct decision, warnings) must not."""
    r = json.loads(json.dumps(report))
    r.pop("search_path")
    for k in ("helper", "cache"):
        r["probing"].pop(k)
    for p in r["plugins"]:
        for k in ("path", "origin", "shadows", "load_us", "probe_us"):
            p.pop(k, None)
        for d in p.get("devices", []):
            d.pop("bandwidth_mbps", None)
            d.pop("detail", None)
    r["plugins"].sort(key=lambda p: (p["kind"], p["name"]))
    return r


def test_info_is_the_report_of_ferry_info_json(tmp_path):
    cli = ferry_cli()
    sysfs = tmp_path / "sys"
    subprocess.run([str(cli), "topology", "--write-fixture", "dgx-h100", str(sysfs)], check=True)
    env = dict(
        FERRY_SYSFS_ROOT=str(sysfs),
        FERRY_PLUGIN_CACHE="off",
        FERRY_STAGING_DEPTH="8",
        FERRY_GPU_DIRECT="peermem",
        FERRY_TRANSPORTS="tcp,shm",
    )
    from_cli = subprocess.run(
        [str(cli), "info", "--json"], capture_output=True, text=True, timeout=120,
        env=env_without_ferry_vars(**env),
    )
    assert from_cli.returncode == 0, from_cli.stderr
    from_py = run_py("import ferry, json; print(json.dumps(dict(ferry.info())))", **env)
    assert from_py.returncode == 0, from_py.stderr
    a, b = json.loads(from_py.stdout), json.loads(from_cli.stdout)
    assert a["config"]["staging_depth"] == "8" and a["gpus"], "nothing was compared"
    assert normalized(a) == normalized(b)
