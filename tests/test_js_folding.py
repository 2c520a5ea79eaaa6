"""The chat page's protocol client under Node: tests/js/folding.test.mjs (node:test, no npm packages).

The client's modules (chat/static/chat/client/*.js) are served as they are, with no package.json saying
they are ES modules; the test runs them from a copy of the same tree that has one, so any Node from 18 on
reads them as modules without detecting their syntax. A machine without Node fails this test rather
than skipping it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.support import ROOT

CLIENT = Path("chat", "static", "chat", "client")
TEST = Path("tests", "js", "folding.test.mjs")


def test_the_chunk_folding_under_node(tmp_path: Path) -> None:
    node = shutil.which("node")
    assert node is not None, "node is not installed: tests/js/folding.test.mjs needs Node.js 18+"
    shutil.copytree(ROOT / CLIENT, tmp_path / CLIENT)
    (tmp_path / CLIENT / "package.json").write_text(json.dumps({"type": "module"}))
    (tmp_path / TEST).parent.mkdir(parents=True)
    shutil.copy(ROOT / TEST, tmp_path / TEST)
    result = subprocess.run(
        [node, "--test", str(TEST)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"node --test failed:\n{result.stdout}\n{result.stderr}"
    assert "# fail 0" in result.stdout and "# pass 0" not in result.stdout, result.stdout
