"""MCP servers' tools in a turn, through the official `mcp` SDK (`pip install "thinkproject[mcp]"`).

An agent names its servers in `Think.mcp_servers` (or `get_mcp_servers()`), each an `MCPServer`: a URL
(streamable HTTP) or a command (stdio). A turn connects to each when it starts, lists its tools, and offers
them to the model beside the agent's own, with the schemas the server gives. A call goes through the same
path as any server tool (`chat.turn.tools.tool_execute`): it is recorded in the transcript, an approval can
be asked for, and a call a crash interrupted is repaired like any other. Its part is a `dynamic-tool`
(the AI SDK's part for tools known only at run time), which also tells the web process that no client
may answer it. The connections close when the turn ends.

A server that cannot be reached, or that lists nothing usable, costs its tools, never the turn: the
model is offered the rest, and the log and the diagnostics channel (`chat:mcp:unavailable`) say why.
What a server sends is bounded: at most MAX_TOOLS tools of at most MAX_SCHEMA_CHARS of schema each,
descriptions cut at MAX_DESCRIPTION_CHARS, outputs at the tools' own bound (MAX_OUTPUT_CHARS).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import sys
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from recovery import diagnostics

from ..exceptions import ToolError
from .tools import TOOL_NAME, Tool

if TYPE_CHECKING:
    from mcp import Client

logger = logging.getLogger(__name__)

MAX_TOOLS = 128  # per server; the rest are left out, and the log says so
MAX_PAGES = 16  # of a paginated tools/list
MAX_SCHEMA_CHARS = 64_000  # a tool's input schema, as JSON
MAX_DESCRIPTION_CHARS = 4_000
CLOSE_TIMEOUT_S = 5.0
SSE_READ_TIMEOUT_S = 300.0  # a server's event stream may be quiet this long between events
SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class MCPServer:
    """An MCP server whose tools the agent's model may call: `url` (streamable HTTP) or `command` (stdio).

    `name`: a label for logs, diagnostics and traces. `tool_prefix` goes in front of each tool's name (so two
    servers' `search` can both be offered); a name that is then not 1-64 letters, digits, '_' or '-', or
    that the agent or an earlier server already uses, is left out. `tools`: only these of the server's
    tools (their names on the server); None, all. `needs_approval`: True for every tool, or the names (on
    the server) of those a human approves before each call. `timeout_s` bounds the connection and the
    listing, and each call. `headers` go with every HTTP request (an `Authorization`, say); `env` and `cwd`
    are the stdio process's (the SDK passes it only a few safe variables of the worker's own by default).
    """

    name: str
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    command: str | None = None
    args: Sequence[str] = ()
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    tool_prefix: str = ""
    tools: Collection[str] | None = None
    needs_approval: bool | Collection[str] = False
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not SERVER_NAME.match(self.name):
            raise ValueError(f"MCP server name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if (self.url is None) == (self.command is None):
            raise ValueError(
                f"MCP server {self.name!r}: give either url (streamable HTTP) or command (stdio)"
            )
        if self.url is not None and not (
            isinstance(self.url, str) and self.url.startswith(("http://", "https://"))
        ):
            raise ValueError(f"MCP server {self.name!r}: url must be an http:// or https:// URL")
        if isinstance(self.args, str):
            raise ValueError(f"MCP server {self.name!r}: args is a list of arguments, not a string")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ValueError(f"MCP server {self.name!r}: timeout_s must be a positive number of seconds")
        if isinstance(self.tools, str) or isinstance(self.needs_approval, str):
            raise ValueError(f"MCP server {self.name!r}: tools and needs_approval take collections of names")

    @property
    def transport(self) -> str:
        return "http" if self.url is not None else "stdio"

    def approves(self, remote_name: str) -> bool:
        if isinstance(self.needs_approval, bool):
            return self.needs_approval
        return remote_name in self.needs_approval


def mcp_server_list(servers: Any) -> list[MCPServer]:
    """`get_mcp_servers()`'s answer, checked: a list of MCPServer (a TypeError names what else it was)."""
    if isinstance(servers, str | bytes) or not isinstance(servers, Iterable):
        raise TypeError(f"get_mcp_servers() must return a list of MCPServer, got {servers!r}")
    found = list(servers)
    for item in found:
        if not isinstance(item, MCPServer):
            raise TypeError(f"get_mcp_servers() must return MCPServer objects, got {item!r}")
    return found


class _Connection:
    """One server's client, held open by a task of its own: the SDK's task groups then live and fail in
    that task, so a server that dies cancels its own calls, never the turn that made them."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server
        self.client: Client | None = None
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> Client:
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(ready), name=f"mcp:{self.server.name}")
        waiters: set[asyncio.Future[Any]] = {ready, self._task}
        try:
            async with asyncio.timeout(self.server.timeout_s):
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            await self.close()
            raise TimeoutError(f"no answer within {self.server.timeout_s:g} s") from None
        if not ready.done():  # the task ended first: it failed to connect
            error = self._task.exception() if not self._task.cancelled() else None
            raise ConnectionError(_reason(error) if error else "the connection was cancelled")
        self.client = ready.result()
        return self.client

    async def _hold(self, ready: asyncio.Future[Client]) -> None:
        async with _connected(self.server) as client:
            ready.set_result(client)
            await self._closing.wait()

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._closing.set()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await asyncio.wait({task})
        except TimeoutError:
            pass
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            logger.info(
                "MCP server %s: the connection ended with %s", self.server.name, _reason(task.exception())
            )


@contextlib.asynccontextmanager
async def _connected(server: MCPServer) -> AsyncIterator[Client]:
    """A client of the server, connected and past the protocol's handshake."""
    from mcp import Client

    if server.url is not None:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        # The SDK takes headers only on a client of one's own, which its caller then closes.
        timeout = httpx2.Timeout(server.timeout_s, read=max(server.timeout_s, SSE_READ_TIMEOUT_S))
        async with httpx2.AsyncClient(headers=dict(server.headers), timeout=timeout) as http:
            transport = streamable_http_client(server.url, http_client=http)
            async with Client(transport, read_timeout_seconds=server.timeout_s) as client:
                yield client
        return
    from mcp.client.stdio import StdioServerParameters, stdio_client

    assert server.command is not None
    parameters = StdioServerParameters(
        command=server.command,
        args=list(server.args),
        env=dict(server.env) if server.env is not None else None,
        cwd=server.cwd,
    )
    # The server's stderr goes to the process's own (a Celery worker replaces sys.stderr by a logging
    # proxy, which a child process cannot write to).
    transport = stdio_client(parameters, errlog=sys.__stderr__ or sys.stderr)
    async with Client(transport, read_timeout_seconds=server.timeout_s) as client:
        yield client


def _reason(error: BaseException | None) -> str:
    """What went wrong, from the innermost exception of the SDK's exception groups."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    if error is None:
        return "unknown"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def _listing(client: Client) -> list[Any]:
    tools: list[Any] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None or len(tools) > MAX_TOOLS:
            break
    return tools


def tool_from_listing(server: MCPServer, listed: Any, client: Client | None) -> Tool | str:
    """The Tool for one listed tool, or why it is left out. `client`: the connection its calls use."""
    remote = str(getattr(listed, "name", ""))
    name = f"{server.tool_prefix}{remote}"
    if not TOOL_NAME.match(name):
        return f"its name {name!r} is not 1-64 letters, digits, '_' or '-'"
    schema = getattr(listed, "input_schema", None)
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return "its input schema is not a JSON schema of type 'object'"
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError):
        return "its input schema is not JSON"
    if size > MAX_SCHEMA_CHARS:
        return f"its input schema is {size} characters, over {MAX_SCHEMA_CHARS}"
    description = str(getattr(listed, "description", None) or "")[:MAX_DESCRIPTION_CHARS]

    async def call(**arguments: Any) -> Any:
        assert client is not None
        try:
            async with asyncio.timeout(server.timeout_s):
                result = await client.call_tool(remote, arguments)
        except TimeoutError:
            raise ToolError(
                f"The MCP server {server.name} did not answer within {server.timeout_s:g} s."
            ) from None
        return call_output(result)

    call.__name__ = call.__qualname__ = name
    return Tool(
        name=name,
        description=description,
        parameters=schema,
        execute=call,
        needs_approval=server.approves(remote),
        dynamic=True,
    )


def call_output(result: Any) -> Any:
    """A CallToolResult as the tool's output: its structured content when it has one, else its text, else
    its content blocks as JSON. A result marked as an error becomes the ToolError the model reads."""
    blocks = list(getattr(result, "content", None) or [])
    texts = [b.text for b in blocks if getattr(b, "type", None) == "text"]
    if getattr(result, "is_error", False):
        raise ToolError("\n".join(texts) or "The MCP tool reported an error.")
    structured = getattr(result, "structured_content", None)
    if structured is not None:
        return structured
    if len(texts) == len(blocks):
        return "\n".join(texts)
    return [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in blocks]


class MCPToolbox:
    """The MCP tools of one turn: `async with MCPToolbox(servers, taken=...) as tools:`; closed with it."""

    def __init__(
        self, servers: Sequence[MCPServer], *, taken: Collection[str] = (), agent: Any = None
    ) -> None:
        self.servers = list(servers)
        self.taken = set(taken)
        self.agent = agent
        self.tools: list[Tool] = []
        self.left_out: list[tuple[str, str, str]] = []  # (server, tool, why)
        self._connections: list[_Connection] = []

    async def __aenter__(self) -> list[Tool]:
        for server in self.servers:
            if server.tools is not None and not server.tools:
                continue
            connection = _Connection(server)
            self._connections.append(connection)
            try:
                client = await connection.open()
                async with asyncio.timeout(server.timeout_s):
                    listed = await _listing(client)
            except Exception as exc:  # unreachable, refused, timed out, not MCP: its tools only are lost
                await connection.close()
                self._unavailable(server, _reason(exc))
                continue
            self._add(server, listed, client)
        return self.tools

    def _add(self, server: MCPServer, listed: list[Any], client: Client) -> None:
        wanted = set(server.tools) if server.tools is not None else None
        offered = 0
        for item in listed:
            remote = str(getattr(item, "name", ""))
            if wanted is not None and remote not in wanted:
                continue
            if offered >= MAX_TOOLS:
                self.left_out.append((server.name, remote, f"the server lists more than {MAX_TOOLS} tools"))
                continue
            made = tool_from_listing(server, item, client)
            if isinstance(made, str):
                self.left_out.append((server.name, remote, made))
                continue
            if made.name in self.taken:
                self.left_out.append((server.name, remote, f"the name {made.name!r} is already a tool's"))
                continue
            self.taken.add(made.name)
            self.tools.append(made)
            offered += 1
        for name, remote, why in self.left_out:
            if name == server.name:
                logger.warning("MCP server %s: tool %r left out: %s", name, remote, why)

    def _unavailable(self, server: MCPServer, reason: str) -> None:
        logger.warning(
            "MCP server %s (%s) is unavailable, its tools are not offered: %s",
            server.name,
            server.transport,
            reason,
        )
        diagnostics.emit(
            "chat:mcp:unavailable",
            {"server": server.name, "transport": server.transport, "reason": reason},
            agent=getattr(self.agent, "agent", ""),
            name=getattr(self.agent, "name", ""),
        )

    async def __aexit__(self, *exc: object) -> None:
        connections, self._connections = self._connections, []
        await asyncio.gather(*(c.close() for c in connections))
