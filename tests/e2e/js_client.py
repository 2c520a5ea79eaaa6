"""Running tests/js/scenarios.mjs: the published `agents` + `ai` npm packages against a live server.

The packages are installed from the committed lock file with `npm ci` when node_modules is missing or
older than the lock; only a machine without `node` skips these tests.
"""

from __future__ import annotations

import fcntl
import functools
import json
import queue
import shutil
import subprocess
import threading
import urllib.request
import uuid
from typing import Any

from tests.support import ROOT, access_token, auth_headers, require

JS_DIR = ROOT / "tests" / "js"
SCRIPT = JS_DIR / "scenarios.mjs"


@functools.cache
def _install() -> str:
    """`npm ci` when needed; returns the node executable. Fails (never skips) if installing fails."""
    node = shutil.which("node")
    if node is None:
        return ""
    lock = JS_DIR / "package-lock.json"
    installed = JS_DIR / "node_modules" / ".package-lock.json"  # npm writes it on every install
    # One install at a time: the runners of a parallel run (pytest-xdist) may both find it missing.
    with open(JS_DIR / ".install.lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if not installed.exists() or installed.stat().st_mtime < lock.stat().st_mtime:
            _npm_ci()
    return node


def _npm_ci() -> None:
    npm = shutil.which("npm")
    assert npm is not None, "node is installed but npm is not: cannot install tests/js"
    result = subprocess.run(
        [npm, "ci", "--prefix", str(JS_DIR), "--no-audit", "--no-fund", "--loglevel=error"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"npm ci --prefix tests/js failed:\n{result.stdout}\n{result.stderr}"


def node_with_packages() -> str:
    """The node executable, with tests/js installed; skips the test when Node.js is missing."""
    node = _install()
    require(bool(node), "node is not installed: the JS client suite needs Node.js (20+) and npm")
    return node


def new_name(tag: str) -> str:
    return f"js-{tag}-{uuid.uuid4().hex[:8]}"


def _args(node: str, port: int, agent: str, name: str, scenario: str, options: dict[str, Any]) -> list[str]:
    options.setdefault("token", access_token())
    return [node, str(SCRIPT), f"127.0.0.1:{port}", agent, name, scenario, json.dumps(options)]


def _result(stdout: str, stderr: str, returncode: int | None) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, f"the scenario printed nothing (exit {returncode}); stderr:\n{stderr}"
    result: dict[str, Any] = json.loads(lines[-1])
    assert result.get("ok"), f"scenario failed: {result.get('error')}\nstderr:\n{stderr}"
    return result


def run_scenario(
    node: str,
    port: int,
    agent: str,
    name: str,
    scenario: str,
    *,
    timeout: float = 45,
    **options: Any,
) -> dict[str, Any]:
    """Run one scenario to its end and return the JSON line it printed (asserting it succeeded)."""
    options.setdefault("timeoutMs", int(timeout * 1000))
    proc = subprocess.run(
        _args(node, port, agent, name, scenario, options),
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=timeout + 15,
    )
    return _result(proc.stdout, proc.stderr, proc.returncode)


class RunningScenario:
    """A scenario started in the background, for tests that act on its progress events (stderr)."""

    def __init__(self, node: str, port: int, agent: str, name: str, scenario: str, **options: Any) -> None:
        self.timeout = options.get("timeoutMs", 45000) / 1000
        options.setdefault("timeoutMs", int(self.timeout * 1000))
        self.proc = subprocess.Popen(
            _args(node, port, agent, name, scenario, options),
            cwd=JS_DIR,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            if line.startswith('{"progress"'):
                self.events.put(json.loads(line))

    def wait_event(self, event: str, timeout: float) -> dict[str, Any]:
        while True:
            try:
                seen = self.events.get(timeout=timeout)
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(
                    f"no {event!r} progress event within {timeout}s:\n{''.join(self.stderr)}"
                ) from None
            if seen["progress"] == event:
                return seen

    def result(self) -> dict[str, Any]:
        try:
            stdout, _ = self.proc.communicate(timeout=self.timeout + 15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(5)
        return _result(stdout, "".join(self.stderr), self.proc.returncode)


def get_messages(port: int, agent: str, name: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/agents/{agent}/{name}/get-messages"
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=10) as response:
        messages: list[dict[str, Any]] = json.loads(response.read())
    return messages


def tab(result: dict[str, Any], label: str = "tab") -> dict[str, Any]:
    return next(t for t in result["tabs"] if t["label"] == label)


def frames(tab_report: dict[str, Any], kind: str, **match: Any) -> list[dict[str, Any]]:
    return [
        f
        for f in tab_report["received"]
        if f["type"] == kind and all(f.get(k) == v for k, v in match.items())
    ]


def chunk_seqs(response_frames: list[dict[str, Any]]) -> list[int]:
    """The seqs of the frames that carry a chunk (not the control frames)."""
    return [f["seq"] for f in response_frames if isinstance(f.get("body"), dict)]


def frames_text(response_frames: list[dict[str, Any]]) -> str:
    return "".join(
        f["body"].get("delta", "")
        for f in response_frames
        if isinstance(f.get("body"), dict) and f["body"].get("type") == "text-delta"
    )


def message_text(message: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for p in message["parts"] if p["type"] == "text")
