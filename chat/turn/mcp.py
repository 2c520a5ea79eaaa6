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

from recovery.observe import diagnostics

from ..exceptions import ToolError
from .tools import TOOL_NAME, Tool

if TYPE_CHECKING:
    from mcp import Client

logger = logging.getLogger(__name__)

MAX_TOOLS = 128  # per server; the rest are left out, and the log says so
MAX_PAGES = 16  # of a paginated tools/list
MAX_SCHEMA_CHARS = 64_000  # a tool's input schema, as JSON
MAX_DESCRIPTION_CHARS = 4_000
MAX_LISTED = 4 * MAX_TOOLS  # read from a server's listing at most (those `tools=` names among them)
MAX_ERROR_CHARS = 10_000  # of an error a server sends, as the model reads it
MAX_LOGGED = 10  # tools left out, named one by one in the log (then a count)
CLOSE_TIMEOUT_S = 2.0  # to end a session gracefully, then again after cancelling it
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
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # a token, say: never in a repr
    command: str | None = None
    args: Sequence[str] = ()
    env: Mapping[str, str] | None = field(default=None, repr=False)
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
        if self.tools is not None:
            object.__setattr__(self, "tools", self._names("tools", self.tools))
        if not isinstance(self.needs_approval, bool):
            object.__setattr__(self, "needs_approval", self._names("needs_approval", self.needs_approval))

    def _names(self, option: str, value: Any) -> frozenset[str]:
        """A collection of tool names, read once (an iterator would be used up by the first turn)."""
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            raise ValueError(f"MCP server {self.name!r}: {option} takes a collection of tool names")
        names = frozenset(value)
        if not all(isinstance(n, str) for n in names):
            raise ValueError(f"MCP server {self.name!r}: {option} takes a collection of tool names")
        return names

    @property
    def transport(self) -> str:
        return "http" if self.url is not None else "stdio"

    def approves(self, remote_name: str) -> bool:
        if isinstance(self.needs_approval, bool):
            return self.needs_approval
        return remote_name in self.needs_approval

    def title(self, remote_name: str) -> str:
        """The title of one of its tools' calls (the part's `title`): which server, which of its tools."""
        return f"{self.name}/{remote_name}"


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
        self._closing = asyncio.Event()
        self._ready = False
        self._task: asyncio.Task[None] | None = None
        self._scope: Any = None  # the hold's anyio cancel scope

    async def open(self) -> Client:
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(ready), name=f"mcp:{self.server.name}")
        waiters: set[asyncio.Future[Any]] = {ready, self._task}
        try:
            async with asyncio.timeout(self.server.timeout_s):
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise TimeoutError(f"no answer within {self.server.timeout_s:g} s") from None
        if not ready.done():  # the task ended first: it failed to connect
            error = self._task.exception() if not self._task.cancelled() else None
            raise ConnectionError(_reason(error) if error else "the connection was cancelled")
        self._ready = True
        return ready.result()

    async def _hold(self, ready: asyncio.Future[Client]) -> None:
        import anyio

        # Cancelled through its anyio scope, never Task.cancel(): the SDK shields its own shutdown (the
        # HTTP session's DELETE, the stdio process stopped) from the first, not from the second.
        with anyio.CancelScope() as self._scope:
            async with _connected(self.server) as client:
                if not ready.done():
                    ready.set_result(client)
                await self._closing.wait()

    async def close(self) -> None:
        """Ends the session (its HTTP session, its stdio process): waits CLOSE_TIMEOUT_S for a graceful
        end, then cancels it and waits CLOSE_TIMEOUT_S more; a shutdown still going on after that (the SDK
        bounds its own) finishes in the background. A connection never ready is cancelled at once."""
        task, self._task = self._task, None
        if task is None:
            return
        self._closing.set()
        if self._ready:
            await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)
        if not task.done():
            if self._scope is not None:
                self._scope.cancel()
            else:  # not started yet: nothing of the SDK's to shut down
                task.cancel()
            await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
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


async def _listing(client: Client) -> tuple[list[Any], str | None]:
    """The server's tools, at most MAX_LISTED of them from at most MAX_PAGES pages; and what was not read."""
    tools: list[Any] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools[: MAX_LISTED - len(tools)])
        cursor = page.next_cursor
        if cursor is None:
            return tools, None
        if len(tools) >= MAX_LISTED:
            return tools, f"it lists more than {MAX_LISTED} tools; the rest were not read"
    return tools, f"it lists more than {MAX_PAGES} pages of tools; the rest were not read"


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
        from mcp import MCPError

        assert client is not None
        try:
            async with asyncio.timeout(server.timeout_s):
                result = await client.call_tool(remote, arguments)
        except TimeoutError:
            raise ToolError(
                f"The MCP server {server.name} did not answer within {server.timeout_s:g} s."
            ) from None
        except MCPError as exc:  # the server refused the call (unknown tool, invalid params, ...)
            raise ToolError(
                _bounded(f"The MCP server {server.name} refused the call: {exc.message}")
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
        title=server.title(remote),
    )


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " [...]"


def call_output(result: Any) -> Any:
    """A CallToolResult as the tool's output: its structured content when it has one, else its text, else
    its content blocks as JSON. A result marked as an error becomes the ToolError the model reads."""
    blocks = list(getattr(result, "content", None) or [])
    texts = [b.text for b in blocks if getattr(b, "type", None) == "text"]
    if getattr(result, "is_error", False):
        raise ToolError(_bounded("\n".join(texts)) or "The MCP tool reported an error.")
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
        """Connect to every server at once, each within its `timeout_s`; offer their tools in the servers'
        order. Whatever stops this (a stop, a lost lease, a bad option) closes what was opened."""
        try:
            opened = await asyncio.gather(*(self._open(server) for server in self.servers))
            for server, found in zip(self.servers, opened, strict=True):
                if found is not None:
                    self._add(server, *found)
        except BaseException:
            await asyncio.shield(self._close_all())
            raise
        return self.tools

    async def _open(self, server: MCPServer) -> tuple[Client, list[Any], str | None] | None:
        if server.tools is not None and not server.tools:
            return None
        connection = _Connection(server)
        self._connections.append(connection)
        try:
            client = await connection.open()
            async with asyncio.timeout(server.timeout_s):
                listed, unread = await _listing(client)
        except Exception as exc:  # unreachable, refused, timed out, not MCP: its tools only are lost
            await connection.close()
            self._unavailable(server, _reason(exc))
            return None
        return client, listed, unread

    def _add(self, server: MCPServer, client: Client, listed: list[Any], unread: str | None = None) -> None:
        wanted = server.tools
        left_out: list[tuple[str, str]] = []
        offered = beyond = 0
        for item in listed:
            remote = str(getattr(item, "name", ""))
            if wanted is not None and remote not in wanted:
                continue
            made = tool_from_listing(server, item, client)
            if isinstance(made, str):
                left_out.append((remote, made))
            elif made.name in self.taken:
                left_out.append((remote, f"the name {made.name!r} is already a tool's"))
            elif offered >= MAX_TOOLS:
                beyond += 1
            else:
                self.taken.add(made.name)
                self.tools.append(made)
                offered += 1
        self.left_out.extend((server.name, remote, why) for remote, why in left_out)
        for remote, why in left_out[:MAX_LOGGED]:
            logger.warning("MCP server %s: tool %r left out: %s", server.name, remote, why)
        if len(left_out) > MAX_LOGGED:
            logger.warning("MCP server %s: %d more tools left out", server.name, len(left_out) - MAX_LOGGED)
        if beyond:
            self.left_out.append((server.name, "", f"{beyond} tools beyond the first {MAX_TOOLS}"))
            logger.warning(
                "MCP server %s: %d tools left out beyond the first %d", server.name, beyond, MAX_TOOLS
            )
        if unread:
            logger.warning("MCP server %s: %s", server.name, unread)

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
        await asyncio.shield(self._close_all())

    async def _close_all(self) -> None:
        connections, self._connections = self._connections, []
        await asyncio.gather(*(c.close() for c in connections))
