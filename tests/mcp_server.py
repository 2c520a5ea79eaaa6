"""An MCP server for the tests, on the official SDK: `python -m tests.mcp_server http PORT` serves it over
streamable HTTP on 127.0.0.1 at /mcp, `python -m tests.mcp_server stdio` over its stdin and stdout.

Each call of a tool appends a line to the file MCP_CALL_LOG names (when set): the tests count how often a
tool really ran, in this process, whatever the worker that called it did afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

ROOT = Path(__file__).resolve().parent.parent
server = MCPServer("think-tests", instructions="Tools for thinkproject's tests.")


def _called(name: str, **arguments: object) -> None:
    path = os.environ.get("MCP_CALL_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"tool": name, "arguments": arguments}) + "\n")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    _called("add", a=a, b=b)
    return a + b


@server.tool()
def order_status(
    order_id: Annotated[str, Field(description="The order's number, like A-1001.")],
    detail: Literal["short", "full"] = "short",
) -> dict[str, object]:
    """Where an order is."""
    _called("order_status", order_id=order_id, detail=detail)
    status: dict[str, object] = {"order": order_id, "status": "shipped"}
    if detail == "full":
        status["carrier"] = "Post"
    return status


@server.tool()
def refuse(reason: str) -> str:
    """Always fails, with the reason given (the SDK's ToolError: the client reads it)."""
    _called("refuse", reason=reason)
    raise ToolError(reason)


@server.tool()
async def slow(seconds: float) -> str:
    """Answers after the given number of seconds."""
    _called("slow", seconds=seconds)
    await asyncio.sleep(seconds)
    return f"waited {seconds} s"


def main(argv: list[str]) -> None:
    if argv[:1] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(argv[1]))
    elif argv[:1] == ["stdio"]:
        server.run("stdio")
    else:
        raise SystemExit("usage: python -m tests.mcp_server http PORT | stdio")


@contextlib.contextmanager
def served(call_log: Path, *, port: int | None = None) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """This server over streamable HTTP in a process of its own, for a test: (the process, its URL)."""
    from tests.support import free_port, wait_until

    port = port or free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.mcp_server", "http", str(port)],
        cwd=ROOT,
        env={**os.environ, "MCP_CALL_LOG": str(call_log)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _listening(port) or process.poll() is not None, 30, "the MCP server to listen")
        assert process.poll() is None, "the MCP server exited"
        yield process, f"http://127.0.0.1:{port}/mcp"
    finally:
        process.kill()
        process.wait(10)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def calls(call_log: Path) -> list[dict[str, object]]:
    """The calls the server ran, as its log has them."""
    if not call_log.exists():
        return []
    return [json.loads(line) for line in call_log.read_text().splitlines() if line]


if __name__ == "__main__":
    main(sys.argv[1:])
