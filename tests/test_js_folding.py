"""The chat page's protocol client under Node: tests/js/folding.test.mjs (node:test, no npm packages).

It imports chat/static/chat/client/*.js as they are served; those files have no package.json saying they
are ES modules, so Node must detect module syntax itself (Node 20.19 and later, 22.7 and later). A
machine without Node fails this test rather than skipping it.
"""

from __future__ import annotations

import shutil
import subprocess

from tests.support import ROOT

TEST = ROOT / "tests" / "js" / "folding.test.mjs"


def test_the_chunk_folding_under_node() -> None:
    node = shutil.which("node")
    assert node is not None, "node is not installed: tests/js/folding.test.mjs needs Node.js 20.19+"
    result = subprocess.run(
        [node, "--test", str(TEST)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"node --test failed:\n{result.stdout}\n{result.stderr}"
    assert "# fail 0" in result.stdout, result.stdout
