"""Shared helpers for Ferry's Python tests (run against the installed wheel;
scripts/test builds and installs it into target/pyenv)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HELPERS = Path(__file__).parent / "helpers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_without_ferry_vars(**extra):
    """The environment a user would have: no FERRY_* at all (so the plugins
    must be found from the package alone), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update(extra)
    return env


class Proc:
    """A helper script in its own process, speaking lines on stdin/stdout."""

    def __init__(self, script, *args, env=None):
        self.p = subprocess.Popen(
            [sys.executable, str(HELPERS / script), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env if env is not None else env_without_ferry_vars(),
        )

    def line(self, timeout=30.0) -> str:
        # A bounded wait: the helper prints its first line within seconds.
        deadline = time.monotonic() + timeout
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.1):
                text = self.p.stdout.readline()
                if text:
                    return text.strip()
                break
            if self.p.poll() is not None:
                break
        raise AssertionError(f"{self.p.args[1]} printed nothing; stderr:\n{self.stderr()}")

    def json(self):
        return json.loads(self.line())

    def send(self, text: str):
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def stderr(self) -> str:
        if self.p.poll() is None:
            self.p.kill()
        try:
            return self.p.communicate(timeout=10)[1]
        except Exception:
            return ""

    def finish(self, timeout=30.0) -> int:
        try:
            self.p.stdin.close()
        except Exception:
            pass
        try:
            return self.p.wait(timeout=timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def proc():
    started = []

    def start(script, *args, env=None):
        p = Proc(script, *args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()


def run_helper(script, *args, env=None, timeout=60):
    return subprocess.run(
        [sys.executable, str(HELPERS / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else env_without_ferry_vars(),
    )


@pytest.fixture(scope="session")
def etcd_url():
    """An etcd on loopback with its own data directory (skipped without the
    `etcd` binary; scripts/test installs Debian's etcd-server)."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd binary (apt-get install etcd-server; scripts/test does)")
    client, peer = free_port(), free_port()
    data = tempfile.mkdtemp(prefix="ferry-py-etcd-")
    c, p = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    proc = subprocess.Popen(
        [binary, "--name", "ferry-py", "--data-dir", data,
         "--listen-client-urls", c, "--advertise-client-urls", c,
         "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
         "--initial-cluster", f"ferry-py={p}", "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", client), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("etcd did not start")
                time.sleep(0.1)
        yield f"etcd://127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)
