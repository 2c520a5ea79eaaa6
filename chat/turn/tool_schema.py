"""A tool's JSON Schema and input validation, built from its function's signature with pydantic.

`def weather(ctx: RunContext, city: str, days: Annotated[int, Field(ge=1, le=7)] = 1)` becomes the
schema of an object with `city` (required) and `days` (an integer from 1 to 7, 1 when left out); the
first parameter, annotated `RunContext`, is the turn's context (chat.turn.context), never the model's.
Plain types, `Literal`, `Enum`, dataclasses, TypedDicts, pydantic models and `Annotated[..., Field(...)]`
all work, since pydantic builds both the schema and the validator from the same annotations. Parameter
descriptions come from `Field(description=...)`, else from the docstring's `Args:` section (Google
style) or its `:param name:` lines (Sphinx style).
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo

from ..exceptions import ToolSchemaError
from .context import RunContext

_ARGS_HEADING = re.compile(r"^(Args|Arguments|Parameters|Params):\s*$")
_GOOGLE_ARG = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX_PARAM = re.compile(r"^:param\s+(?:[^:]*\s)?(\w+)\s*:\s*(.*)$")


@dataclass(frozen=True)
class Signature:
    """What a tool function asks for: the model's input (a pydantic model), and where its context goes."""

    model: type[BaseModel] | None  # None: parameters were written by hand, the input is only bound
    context_param: str | None  # the RunContext parameter's name
    extra: bool  # **kwargs: properties the schema does not name are passed on

    def schema(self) -> dict[str, Any]:
        assert self.model is not None
        schema = self.model.model_json_schema()
        schema.pop("title", None)
        schema.setdefault("properties", {})
        return schema

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of the call: the model's input validated and converted (dataclasses,
        enums and models built, "3" read as 3 where an int is asked for); raises ValidationError."""
        if self.model is None:
            return dict(arguments)
        validated = self.model.model_validate(arguments)
        kwargs = {name: getattr(validated, name) for name in type(validated).model_fields}
        kwargs.update(validated.model_extra or {})
        return kwargs


def docstring_parts(func: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The docstring without its parameters (the tool's description), and each parameter's description
    from a Google-style `Args:` section or Sphinx-style `:param name:` lines."""
    description: list[str] = []
    params: dict[str, str] = {}
    mode: str | None = None  # "args": in an Args section; "param": in a :param: entry
    current = ""
    arg_indent = -1
    for line in (inspect.getdoc(func) or "").splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        sphinx = _SPHINX_PARAM.match(stripped)
        if sphinx:
            mode, current = "param", sphinx.group(1)
            params[current] = sphinx.group(2).strip()
            continue
        if mode == "param":
            if stripped and indent > 0 and not stripped.startswith(":"):
                params[current] = f"{params[current]} {stripped}".strip()
                continue
            mode = None
        if indent == 0 and _ARGS_HEADING.match(stripped):
            mode, current, arg_indent = "args", "", -1
            continue
        if mode == "args":
            if not stripped:
                continue
            if indent == 0:
                mode = None  # the section ended: the line is the description's again
            else:
                arg = _GOOGLE_ARG.match(stripped)
                if arg and (arg_indent < 0 or indent <= arg_indent):
                    arg_indent, current = indent, arg.group(1).lstrip("*")
                    params[current] = arg.group(2).strip()
                elif current:
                    params[current] = f"{params[current]} {stripped}".strip()
                continue
        description.append(line)
    return "\n".join(description).strip(), {k: v for k, v in params.items() if v}


def is_context(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, RunContext) or annotation == "RunContext"


def read_signature(func: Callable[..., Any], *, build_schema: bool) -> Signature:
    """The tool function's signature; `build_schema` False when the schema was written by hand (the
    input is then bound as the model wrote it, and only the context parameter is looked for)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError) as exc:
        if not build_schema:
            return Signature(None, None, True)
        raise ToolSchemaError(f"its signature cannot be read: {exc}") from exc
    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except Exception as exc:  # an unresolvable forward reference, say
        if build_schema:
            raise ToolSchemaError(f"its type hints cannot be resolved: {exc}") from exc
        hints = {}
    _, described = docstring_parts(func)
    fields: dict[str, Any] = {}
    context_param: str | None = None
    extra = False
    for index, (name, param) in enumerate(signature.parameters.items()):
        annotation = hints.get(name, param.annotation)
        if is_context(_bare(annotation)):
            if index != 0:
                raise ToolSchemaError(f"RunContext must be its first parameter, not {name!r}")
            context_param = name
            continue
        if not build_schema:  # a schema written by hand: the input is bound as it was before
            extra = extra or param.kind is inspect.Parameter.VAR_KEYWORD
            continue
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise ToolSchemaError(f"*{name}: a tool is called with keyword arguments only")
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ToolSchemaError(f"{name!r} is positional-only: a tool is called with keyword arguments")
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = True
            continue
        if annotation is inspect.Parameter.empty:
            annotation = Any
        if name in described and not _has_description(annotation):
            annotation = Annotated[annotation, Field(description=described[name])]
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[name] = (annotation, default)
    if not build_schema:
        return Signature(None, context_param, extra)
    config = ConfigDict(extra="allow" if extra else "forbid", arbitrary_types_allowed=False)
    try:
        model = create_model(_model_name(func), __config__=config, **fields)
        signature_out = Signature(model, context_param, extra)
        signature_out.schema()
    except Exception as exc:  # pydantic's schema errors, a name pydantic reserves, ...
        raise ToolSchemaError(_schema_problem(exc)) from exc
    return signature_out


def _schema_problem(error: Exception) -> str:
    """pydantic's reason, as the tool's author can act on it (not "set arbitrary_types_allowed")."""
    text = (str(error).splitlines() or [type(error).__name__])[0].rstrip(".")
    unknown = re.match(
        r"Unable to generate pydantic-core schema for (.*?)\. Set `arbitrary_types_allowed", text
    )
    if unknown:
        return f"pydantic cannot validate the type {unknown.group(1)} (use a type it can, or parameters=...)"
    return text


MAX_ERRORS = 10  # the model writes the input, so it decides how many errors there are: a bound
MAX_LOCATION_CHARS = 100
MAX_MESSAGE_CHARS = 2000


def validation_message(error: ValidationError) -> str:
    """pydantic's errors in one line the model can act on: `where: what` for each, the first
    MAX_ERRORS of them, within MAX_MESSAGE_CHARS (the text is stored, streamed and read by the model)."""
    errors = error.errors(include_url=False, include_input=False, include_context=False)
    found = []
    for item in errors[:MAX_ERRORS]:
        where = ".".join(str(part) for part in item.get("loc", ())) or "input"
        if len(where) > MAX_LOCATION_CHARS:
            where = where[:MAX_LOCATION_CHARS] + "..."
        found.append(f"{where}: {item.get('msg', 'invalid')}")
    if len(errors) > MAX_ERRORS:
        found.append(f"and {len(errors) - MAX_ERRORS} more")
    text = "; ".join(found)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."


def _bare(annotation: Any) -> Any:
    """`Annotated[X, ...]` -> X."""
    if typing.get_origin(annotation) is Annotated:
        return typing.get_args(annotation)[0]
    return annotation


def _has_description(annotation: Any) -> bool:
    if typing.get_origin(annotation) is not Annotated:
        return False
    return any(isinstance(m, FieldInfo) and m.description for m in typing.get_args(annotation)[1:])


def _model_name(func: Callable[..., Any]) -> str:
    name = re.sub(r"\W", "_", getattr(func, "__name__", "tool"))
    return name if name.isidentifier() else "tool"
