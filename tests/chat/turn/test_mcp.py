"""MCP servers' tools (chat.turn.mcp) against a real MCP server on the official SDK (tests/mcp_server.py),
over streamable HTTP in a process of its own and over stdio: listing, schemas, calls, errors, time
limits, bounds on what a server sends, and a server that dies under a running turn."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mcp_types import CallToolResult, ImageContent, TextContent

from chat.agents import MCPServer, Think
from chat.exceptions import ToolError
from chat.turn import mcp
from chat.turn.chunking import UIChunker
from chat.turn.llm import StepFinish, ToolCallDelta
from chat.turn.mcp import MCPToolbox, call_output, mcp_server_list, tool_from_listing
from chat.turn.tools import Tool, Toolset, approved_call_problem, tool, tool_execute
from recovery.observe import diagnostics
from tests.mcp_server import ROOT, calls, served
from tests.support import free_port


@pytest.fixture(scope="module")
def call_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcp") / "calls.jsonl"


@pytest.fixture(scope="module")
def shop_url(call_log: Path) -> Iterator[str]:
    with served(call_log) as (_, url):
        yield url


def shop(url: str, **options: Any) -> MCPServer:
    return MCPServer("shop", url=url, tool_prefix="shop_", **options)


def local(call_log: Path, **options: Any) -> MCPServer:
    return MCPServer(
        "local",
        command=sys.executable,
        args=["-m", "tests.mcp_server", "stdio"],
        env={"MCP_CALL_LOG": str(call_log)},
        cwd=str(ROOT),
        **options,
    )


def by_name(tools: list[Tool]) -> dict[str, Tool]:
    return {t.name: t for t in tools}


# -- configuration ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "problem"),
    [
        ({}, "either url"),
        ({"url": "http://x/mcp", "command": "x"}, "either url"),
        ({"url": "ftp://x/mcp"}, "http:// or https://"),
        ({"command": "x", "args": "-m server"}, "list of arguments"),
        ({"url": "http://x/mcp", "timeout_s": 0}, "timeout_s"),
        ({"url": "http://x/mcp", "timeout_s": float("inf")}, "timeout_s"),
        ({"url": "http://x/mcp", "tools": "add"}, "collection of tool names"),
        ({"url": "http://x/mcp", "needs_approval": None}, "collection of tool names"),
        ({"url": "http://x/mcp", "tools": [1]}, "collection of tool names"),
    ],
)
def test_a_server_is_named_once_by_a_url_or_a_command(options: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        MCPServer("s", **options)


def test_a_server_name_is_a_short_label() -> None:
    with pytest.raises(ValueError, match="1-64 letters"):
        MCPServer("my shop", url="http://x/mcp")


def test_names_are_read_once_and_secrets_stay_out_of_a_repr() -> None:
    server = MCPServer(
        "s",
        url="http://x/mcp",
        headers={"Authorization": "Bearer sk-secret"},
        tools=(n for n in ["add", "refuse"]),
        needs_approval=(n for n in ["refuse"]),
    )
    assert server.tools == {"add", "refuse"} and server.needs_approval == {"refuse"}
    assert server.approves("refuse") and server.approves("refuse") and not server.approves("add")
    stdio = MCPServer("t", command="x", env={"API_KEY": "sk-env"})
    assert "sk-secret" not in repr(server) and "sk-env" not in repr(stdio)


def test_get_mcp_servers_must_answer_mcp_servers() -> None:
    assert mcp_server_list(()) == []
    with pytest.raises(TypeError, match="MCPServer objects"):
        mcp_server_list([{"url": "http://x/mcp"}])
    with pytest.raises(TypeError, match="list of MCPServer"):
        mcp_server_list("http://x/mcp")


def test_manage_py_check_refuses_mcp_servers_that_are_not_servers() -> None:
    class Wrong(Think):
        model = "openai/x"
        mcp_servers = ["http://x/mcp"]  # type: ignore[list-item]

    class Right(Think):
        model = "openai/x"
        mcp_servers = [MCPServer("s", url="http://x/mcp")]

    assert [m.id for m in Wrong.check()] == ["think_chat.E031"]
    assert Right.check() == []


# -- a server's tools, over streamable HTTP and stdio ------------------------------------------------------
async def test_an_http_servers_tools_join_with_its_own_schemas(shop_url: str) -> None:
    async with MCPToolbox([shop(shop_url)]) as tools:
        found = by_name(tools)
        assert set(found) == {"shop_add", "shop_order_status", "shop_refuse", "shop_slow"}
        status = found["shop_order_status"]
        assert status.dynamic and not status.needs_approval
        assert status.description == "Where an order is."
        assert status.parameters["required"] == ["order_id"]
        assert (
            status.parameters["properties"]["order_id"]["description"] == "The order's number, like A-1001."
        )
        assert status.parameters["properties"]["detail"]["enum"] == ["short", "full"]


async def test_a_call_returns_the_servers_structured_content(shop_url: str, call_log: Path) -> None:
    async with MCPToolbox([shop(shop_url)]) as tools:
        found = by_name(tools)
        added = await tool_execute(found["shop_add"], {"a": 2, "b": 40})
        status = await tool_execute(found["shop_order_status"], {"order_id": "A-7", "detail": "full"})
    assert (added.output, added.error_text) == ({"result": 42}, None)
    assert status.output == {"order": "A-7", "status": "shipped", "carrier": "Post"}
    assert {"tool": "add", "arguments": {"a": 2, "b": 40}} in calls(call_log)


async def test_a_tools_error_and_bad_input_reach_the_model_as_tool_errors(shop_url: str) -> None:
    async with MCPToolbox([shop(shop_url)]) as tools:
        found = by_name(tools)
        refused = await tool_execute(found["shop_refuse"], {"reason": "no refunds on Sundays"})
        invalid = await tool_execute(found["shop_add"], {"a": "many"})
    assert refused.failure is None and (refused.error_text or "").endswith(": no refunds on Sundays")
    assert invalid.failure is None and invalid.error_text is not None
    assert "validation error" in invalid.error_text and "b" in invalid.error_text


async def test_a_call_past_its_time_limit_is_a_tool_error(shop_url: str) -> None:
    async with MCPToolbox([shop(shop_url, timeout_s=0.5)]) as tools:
        outcome = await tool_execute(by_name(tools)["shop_slow"], {"seconds": 5})
    assert outcome.error_text == "The MCP server shop did not answer within 0.5 s."


async def test_a_stdio_servers_tools_run_in_its_own_process(call_log: Path) -> None:
    async with MCPToolbox([local(call_log, tools=["add"])]) as tools:
        [add] = tools
        outcome = await tool_execute(add, {"a": 20, "b": 22})
    assert (add.name, outcome.output) == ("add", {"result": 42})
    assert {"tool": "add", "arguments": {"a": 20, "b": 22}} in calls(call_log)


async def test_only_the_tools_named_are_offered_and_approvals_are_per_tool(shop_url: str) -> None:
    server = shop(shop_url, tools=["add", "refuse"], needs_approval=["refuse"])
    async with MCPToolbox([server]) as tools:
        assert {t.name: t.needs_approval for t in tools} == {"shop_add": False, "shop_refuse": True}
    async with MCPToolbox([shop(shop_url, needs_approval=True)]) as tools:
        assert all(t.needs_approval for t in tools) and len(tools) == 4


async def test_the_agents_own_tools_and_earlier_servers_keep_their_names(
    shop_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    @tool
    def shop_add(a: int) -> int:
        """The agent's own."""
        return a

    servers = [shop(shop_url), MCPServer("again", url=shop_url, tool_prefix="shop_")]
    with caplog.at_level(logging.WARNING, logger="chat.turn.mcp"):
        async with MCPToolbox(servers, taken={"shop_add"}) as tools:
            toolset = Toolset([shop_add, *tools])
            assert [t.name for t in tools] == ["shop_order_status", "shop_refuse", "shop_slow"]
            assert toolset.get("shop_add") is shop_add
            assert toolset.dynamic == {
                "shop_order_status": "shop/order_status",
                "shop_refuse": "shop/refuse",
                "shop_slow": "shop/slow",
            }
    assert "tool 'add' left out: the name 'shop_add' is already a tool's" in caplog.text
    assert "MCP server again: tool 'slow' left out" in caplog.text


async def test_an_unreachable_server_costs_its_tools_not_the_turn(
    shop_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    events: list[dict[str, Any]] = []
    unsubscribe = diagnostics.subscribe(diagnostics.channel_for("chat:mcp:unavailable"), events.append)
    gone = MCPServer("gone", url=f"http://127.0.0.1:{free_port()}/mcp", timeout_s=5)
    try:
        with caplog.at_level(logging.WARNING, logger="chat.turn.mcp"):
            async with MCPToolbox([gone, shop(shop_url, tools=["add"])]) as tools:
                assert [t.name for t in tools] == ["shop_add"]
    finally:
        unsubscribe()
    [event] = [e for e in events if e["type"] == "chat:mcp:unavailable"]
    assert event["payload"]["server"] == "gone" and "ConnectError" in event["payload"]["reason"]
    assert "MCP server gone (http) is unavailable" in caplog.text


async def test_a_server_that_dies_under_a_turn_fails_its_calls_and_nothing_else(tmp_path: Path) -> None:
    """The SDK's task groups live in a task per connection: the server's death cancels the call, not the
    coroutine (the turn) that made it, and the toolbox still closes."""
    with served(tmp_path / "calls.jsonl") as (process, url):
        async with MCPToolbox([MCPServer("brief", url=url, timeout_s=5)]) as tools:
            slow = by_name(tools)["slow"]
            call = asyncio.create_task(tool_execute(slow, {"seconds": 30}))
            await asyncio.sleep(0.5)
            process.kill()
            outcome = await asyncio.wait_for(call, 10)
            assert outcome.output is None and (outcome.failure is not None or outcome.error_text)
            await asyncio.sleep(0.1)  # the turn goes on
            again = await asyncio.wait_for(tool_execute(slow, {"seconds": 0}), 10)
            assert again.output is None


# -- what a server sends is bounded --------------------------------------------------------------------------
def listed(name: str = "t", schema: Any = None, description: str = "d") -> Any:
    return SimpleNamespace(
        name=name,
        description=description,
        input_schema={"type": "object", "properties": {}} if schema is None else schema,
    )


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        (listed("files.read"), "is not 1-64 letters"),
        (listed("x" * 60), "is not 1-64 letters"),  # 64 with the prefix "demo_"
        (listed(schema={"type": "array"}), "not a JSON schema of type 'object'"),
        (listed(schema=[]), "not a JSON schema of type 'object'"),
        (listed(schema={"type": "object", "description": "x" * 70_000}), "over 64000"),
    ],
)
def test_a_tool_a_server_lists_badly_is_left_out_with_the_reason(item: Any, problem: str) -> None:
    made = tool_from_listing(MCPServer("demo", url="http://x/mcp", tool_prefix="demo_"), item, None)
    assert isinstance(made, str) and problem in made


def test_a_long_description_is_cut_and_a_server_offers_at_most_max_tools() -> None:
    server = MCPServer("demo", url="http://x/mcp")
    made = tool_from_listing(server, listed(description="y" * 10_000), None)
    assert isinstance(made, Tool) and len(made.description) == mcp.MAX_DESCRIPTION_CHARS
    box = MCPToolbox([server])
    box._add(server, None, [listed(f"t{i}") for i in range(mcp.MAX_TOOLS + 5)])  # type: ignore[arg-type]
    assert len(box.tools) == mcp.MAX_TOOLS
    assert [why for _, _, why in box.left_out] == [f"5 tools beyond the first {mcp.MAX_TOOLS}"]


async def test_a_listing_is_read_up_to_a_bound() -> None:
    class Pages:
        """A server whose every page lists 100 tools and names a next one."""

        async def list_tools(self, *, cursor: str | None = None) -> Any:
            page = int(cursor or 0)
            tools = [listed(f"p{page}_{i}") for i in range(100)]
            return SimpleNamespace(tools=tools, next_cursor=str(page + 1))

    tools, unread = await mcp._listing(Pages())  # type: ignore[arg-type]
    assert len(tools) == mcp.MAX_LISTED and "the rest were not read" in (unread or "")


def test_a_results_form_decides_the_output() -> None:
    text = TextContent(type="text", text="hello")
    image = ImageContent(type="image", data="aGk=", mime_type="image/png")
    assert call_output(CallToolResult(content=[text], structured_content={"a": 1})) == {"a": 1}
    assert call_output(CallToolResult(content=[text, text])) == "hello\nhello"
    assert call_output(CallToolResult(content=[text, image])) == [
        {"type": "text", "text": "hello"},
        {"type": "image", "data": "aGk=", "mimeType": "image/png"},
    ]
    with pytest.raises(ToolError, match="hello"):
        call_output(CallToolResult(content=[text], is_error=True))
    with pytest.raises(ToolError) as huge:
        call_output(CallToolResult(content=[TextContent(type="text", text="e" * 50_000)], is_error=True))
    assert len(str(huge.value)) == mcp.MAX_ERROR_CHARS + len(" [...]")


# -- their calls are dynamic-tool parts --------------------------------------------------------------------
def test_an_mcp_tools_calls_are_marked_dynamic_with_their_servers_title() -> None:
    chunker = UIChunker("m", dynamic={"shop_add": "shop/add"})
    start = chunker.feed(ToolCallDelta(0, "c1", "shop_add", '{"a":1}'))
    chunker.feed(ToolCallDelta(1, "c2", "local", "{}"))
    done = chunker.feed(StepFinish("tool_calls"))
    assert start[0] == {
        "type": "tool-input-start",
        "toolCallId": "c1",
        "toolName": "shop_add",
        "dynamic": True,
        "title": "shop/add",
    }
    assert [(c.get("dynamic"), c.get("title")) for c in done] == [(True, "shop/add"), (None, None)]


def test_an_approved_mcp_call_runs_on_the_server_approved_or_nowhere() -> None:
    here = tool_from_listing(MCPServer("shop", url="http://x/mcp"), listed("cancel"), None)
    there = tool_from_listing(MCPServer("other", url="http://y/mcp"), listed("cancel"), None)
    assert isinstance(here, Tool) and isinstance(there, Tool)
    part = {
        "type": "dynamic-tool",
        "toolName": "cancel",
        "title": "shop/cancel",
        "state": "approval-responded",
    }
    assert approved_call_problem(here, part) is None
    assert approved_call_problem(there, part) == (
        "The tool cancel that was approved (shop/cancel) is not offered now, so it did not run."
    )
    assert approved_call_problem(None, part) == "The model called a tool that does not exist: cancel"


async def test_a_tool_the_server_does_not_have_is_a_tool_error(shop_url: str) -> None:
    server = shop(shop_url)
    connection = mcp._Connection(server)
    client = await connection.open()
    try:
        missing = tool_from_listing(server, listed("no_such_tool"), client)
        assert isinstance(missing, Tool)
        refused = await tool_execute(missing, {})
    finally:
        await connection.close()
    assert refused.failure is None and refused.error_text == "Unknown tool: no_such_tool"


async def test_a_json_rpc_error_is_a_bounded_tool_error() -> None:
    from mcp import MCPError

    class Refusing:
        async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
            raise MCPError(-32602, "Invalid params: " + "x" * 20_000)

    made = tool_from_listing(MCPServer("shop", url="http://x/mcp"), listed("t"), Refusing())  # type: ignore[arg-type]
    assert isinstance(made, Tool)
    outcome = await tool_execute(made, {})
    assert outcome.failure is None and outcome.error_text is not None
    assert outcome.error_text.startswith("The MCP server shop refused the call: Invalid params: xxx")
    assert len(outcome.error_text) == mcp.MAX_ERROR_CHARS + len(" [...]")


async def test_a_turn_stopped_while_it_connects_leaves_nothing_running(call_log: Path) -> None:
    """Cancelled in __aenter__ (a stop, a lost lease), the toolbox closes what it opened: no task holds a
    connection, and the stdio server's process is gone."""
    hang = MCPServer("hang", command=sys.executable, args=["-c", "import time; time.sleep(60)"])
    box = MCPToolbox([local(call_log), hang])
    entering = asyncio.create_task(box.__aenter__())
    await asyncio.sleep(2)  # the stdio server is up, the other one never answers
    entering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await entering
    assert box._connections == []

    def held() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name().startswith("mcp:")]

    for _ in range(150):  # the SDK's own shutdown of a server that ignores its closed stdin is bounded
        if not held():
            break
        await asyncio.sleep(0.1)
    assert held() == []


@pytest.mark.django_db(transaction=True)
async def test_get_mcp_servers_may_read_the_database_and_may_be_async() -> None:
    from chat.models import Conversation
    from chat.turn.runner import _mcp_servers

    class FromDatabase(Think):
        def get_mcp_servers(self) -> list[MCPServer]:
            from django.db import connection

            try:
                count = Conversation.objects.count()  # the ORM: refused on the event loop itself
            finally:
                connection.close()  # this thread's, or the test database could not be dropped
            return [MCPServer(f"s{count}", url="http://x/mcp")]

    class Async(Think):
        async def get_mcp_servers(self) -> list[MCPServer]:  # type: ignore[override]
            return [MCPServer("later", url="http://x/mcp")]

    found = await _mcp_servers(FromDatabase(agent="x", name="n"))
    assert len(found) == 1 and found[0].name.removeprefix("s").isdigit()
    assert [s.name for s in await _mcp_servers(Async(agent="x", name="n"))] == ["later"]
