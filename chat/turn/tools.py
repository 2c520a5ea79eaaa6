"""Tools: server tools (run in the worker), client tools (declared by the client) and approvals.

A server tool is a Python callable, sync or async, called with the model's input object as keyword
arguments. Its JSON Schema is built from its type hints and docstring (chat.turn.tool_schema), and the
model's input is validated and converted before the call: input that does not fit goes back to the model
as a tool error it can correct. A first parameter annotated `RunContext` receives the turn's context.
`parameters=` writes the schema by hand instead (the input is then passed as the model wrote it).

A tool without `execute` is answered by the client (`cf_agent_tool_result`); a tool with `needs_approval`
waits for a human's approval before it runs. A tool that raises `ToolError` gives the model that text;
any other exception is a fault (`chat.turn.faults`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from recovery.process.runtime import maybe_await

from ..exceptions import ToolError, ToolSchemaError
from ..transcript.folding import tool_name_of
from ..types import Chunk, Part
from .context import RunContext
from .tool_schema import Signature, docstring_parts, read_signature, validation_message

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_OUTPUT_CHARS = 200_000
UNKNOWN_TOOL = "The model called a tool that does not exist: {name}"


def _empty_schema() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One tool the model may call. `execute` None means the client answers it.

    `parameters` None: built from `execute`'s signature (an empty object for a client tool). A signature
    the schema cannot be built from leaves `schema_error` set: `manage.py check` reports it, and a turn
    offered the tool fails rather than give the model a schema that lies."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = None  # type: ignore[assignment]  # set in __post_init__
    execute: Callable[..., Any] | None = None
    needs_approval: bool = False
    signature: Signature | None = field(default=None, compare=False, repr=False)
    schema_error: str | None = field(default=None, compare=False)
    #: Known only at run time (an MCP server's): its calls are `dynamic-tool` parts, which no client answers.
    dynamic: bool = False
    #: The `title` of its calls' parts; a dynamic tool's names its origin ("<MCP server>/<its tool>").
    title: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TOOL_NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        if self.execute is not None and not callable(self.execute):
            raise TypeError(f"tool {self.name!r}: execute must be callable")
        if self.needs_approval and self.execute is None:
            raise ValueError(f"tool {self.name!r}: needs_approval requires a server tool with execute")
        written = self.parameters is not None
        if self.execute is not None and self.signature is None:
            try:
                object.__setattr__(self, "signature", read_signature(self.execute, build_schema=not written))
            except ToolSchemaError as exc:
                object.__setattr__(self, "schema_error", f"tool {self.name!r}: {exc}")
        if not written:
            signature = self.signature
            built = signature.schema() if signature is not None and signature.model is not None else None
            object.__setattr__(self, "parameters", built or _empty_schema())
        if not isinstance(self.parameters, dict) or self.parameters.get("type", "object") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema of type 'object'")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The function itself (a decorated tool stays callable, in tests say)."""
        if self.execute is None:
            raise TypeError(f"{self.name!r} is a client tool: the client runs it")
        return self.execute(*args, **kwargs)

    @property
    def is_client(self) -> bool:
        return self.execute is None

    def schema(self) -> dict[str, Any]:
        """The chat-completions `tools` entry."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
    needs_approval: bool = False,
) -> Any:
    """Decorator: `@tool` or `@tool(needs_approval=True)` turns a function into a Tool, its schema built
    from the type hints and the docstring; `parameters={...}` writes the schema by hand instead."""

    def wrap(func: Callable[..., Any]) -> Tool:
        return Tool(
            name=name or func.__name__,
            description=description if description is not None else _description(func, parameters),
            parameters=parameters,  # type: ignore[arg-type]  # None: built from the signature
            execute=func,
            needs_approval=needs_approval,
        )

    return wrap(fn) if fn is not None else wrap


def _description(func: Callable[..., Any], parameters: dict[str, Any] | None) -> str:
    """The docstring; without its parameters' section when they went into the schema built from it."""
    if parameters is not None:
        return inspect.getdoc(func) or ""
    return docstring_parts(func)[0]


def client_tool_from_declaration(declaration: dict[str, Any]) -> Tool | None:
    """A client tool from the request body's `clientTools` entry; None when the entry is unusable."""
    parameters = declaration.get("parameters")
    try:
        return Tool(
            name=str(declaration.get("name", "")),
            description=str(declaration.get("description") or ""),
            parameters=parameters if isinstance(parameters, dict) else _empty_schema(),
        )
    except (TypeError, ValueError):
        return None


class Toolset:
    """The tools of one turn: the agent's server tools (its own, then its MCP servers'), then the client's
    (a server tool wins a name)."""

    def __init__(self, server: Iterable[Tool], client: Iterable[dict[str, Any]] | None = None) -> None:
        self.tools: dict[str, Tool] = {}
        for item in server:
            if not isinstance(item, Tool):
                raise TypeError(f"get_tools() must return Tool objects, got {item!r}")
            if item.schema_error is not None:
                raise ImproperlyConfigured(f"{item.schema_error} (think_chat.E029)")
            self.tools[item.name] = item
        for declaration in client or ():
            declared = client_tool_from_declaration(declaration) if isinstance(declaration, dict) else None
            if declared is not None and declared.name not in self.tools:
                self.tools[declared.name] = declared

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    @property
    def dynamic(self) -> dict[str, str | None]:
        """The tools known only at run time (an MCP server's): name -> the title of their calls."""
        return {name: item.title for name, item in self.tools.items() if item.dynamic}

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def __bool__(self) -> bool:
        return bool(self.tools)


@dataclass(frozen=True)
class ToolOutcome:
    output: Any = None
    error_text: str | None = None  # what the model and the client read
    failure: BaseException | None = None  # an unexpected exception: a fault (chat.turn.faults)
    detail: str | None = None  # the failure as operators see it (traces), never sent

    def chunk(self, tool_call_id: str) -> Chunk:
        if self.error_text is not None or self.failure is not None:
            # A failure is never sent as it is (chat.turn.faults names it); unrecorded, it says only this.
            text = self.error_text if self.error_text is not None else "The tool failed."
            return {"type": "tool-output-error", "toolCallId": tool_call_id, "errorText": text}
        return {"type": "tool-output-available", "toolCallId": tool_call_id, "output": self.output}


def _json_safe(value: Any) -> Any:
    """Outputs are stored as JSON: dataclasses, pydantic models, enums, dates and the like become their
    JSON form (pydantic's), anything else its string form."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        try:
            value = to_jsonable_python(value)
            text = json.dumps(value)
        except (TypeError, ValueError, PydanticSerializationError):
            return str(value)
    if len(text) > MAX_OUTPUT_CHARS:
        raise ToolError(f"the tool output is larger than {MAX_OUTPUT_CHARS} characters")
    return value


def input_problem(item: Tool, tool_input: Any) -> str | None:
    """The tool error a call's input gets before anything else happens (an approval is asked only for
    input the tool would accept); None when it fits."""
    signature = item.signature
    if signature is None or signature.model is None:
        return None
    try:
        signature.validate(tool_input if isinstance(tool_input, dict) else {})
    except ValidationError as exc:
        return f"Invalid input for tool {item.name}: {validation_message(exc)}"
    except Exception:  # the tool's own validator failed: its run reports it
        return None
    return None


def approved_call_problem(item: Tool | None, part: Part) -> str | None:
    """Why an approved call cannot run now (the model reads it as the call's error); None when it can.

    An MCP tool approved on one server runs there or nowhere: its name may have passed to another
    server's tool since (the first one down, or its list changed), and the part's title names the server
    the person approved."""
    name = tool_name_of(part)
    if item is None or item.is_client:
        return UNKNOWN_TOOL.format(name=name)
    if item.dynamic and part.get("title") != item.title:
        return (
            f"The tool {name} that was approved ({part.get('title')}) is not offered now, so it did not run."
        )
    return None


async def tool_execute(item: Tool, tool_input: Any, context: RunContext | None = None) -> ToolOutcome:
    """Run a server tool. Input that does not fit its signature, and a `ToolError`, become the output
    error the model reads (and may correct); any other exception is returned as the outcome's `failure`,
    for the caller to record and replace by a generic text. `context`: for a tool that asks for it."""
    assert item.execute is not None
    signature = item.signature
    given = tool_input if isinstance(tool_input, dict) else {}
    try:
        arguments = signature.validate(given) if signature is not None else dict(given)
        if signature is not None and signature.context_param is not None:
            if signature.context_param in arguments:
                raise TypeError(f"unexpected argument {signature.context_param!r}")
            arguments[signature.context_param] = context
        inspect.signature(item.execute).bind(**arguments)
    except ValidationError as exc:
        return ToolOutcome(error_text=f"Invalid input for tool {item.name}: {validation_message(exc)}")
    except TypeError as exc:
        return ToolOutcome(error_text=f"Invalid input for tool {item.name}: {exc}")
    except Exception as exc:  # a validator of the tool's own types failed: a fault, like the tool's own
        return ToolOutcome(failure=exc)
    try:
        if inspect.iscoroutinefunction(item.execute):
            result = await item.execute(**arguments)
        else:
            loop = asyncio.get_running_loop()
            copied = contextvars.copy_context()  # current_agent() works in sync tools too
            call = functools.partial(copied.run, item.execute, **arguments)
            result = await maybe_await(await loop.run_in_executor(None, call))
        return ToolOutcome(output=_json_safe(result))
    except ToolError as exc:
        return ToolOutcome(error_text=str(exc) or f"The tool {item.name} failed.")
    except Exception as exc:
        return ToolOutcome(failure=exc)
