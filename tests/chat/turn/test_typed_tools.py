"""Tools from type hints (chat.turn.tool_schema): the schema the model reads, the validation and conversion
of its input, the RunContext parameter, and the mistakes `manage.py check` reports."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from typing import Annotated, Any, Literal

import pytest
from django.core.exceptions import ImproperlyConfigured
from pydantic import BaseModel, Field
from typing_extensions import TypedDict  # pydantic wants it on Python 3.11

from chat.agents import RunContext, Think, Tool, ToolError, tool
from chat.turn.tool_schema import docstring_parts
from chat.turn.tools import Toolset, tool_execute


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


@dataclasses.dataclass
class Place:
    city: str
    country: str = "FR"


class Window(BaseModel):
    days: int = Field(ge=1, le=7)


class Range(TypedDict):
    low: int
    high: int


@tool
def forecast(
    ctx: RunContext,
    place: Place,
    unit: Unit = Unit.CELSIUS,
    mode: Literal["now", "week"] = "now",
    window: Window | None = None,
    hours: Annotated[int, Field(description="Hours ahead, from the Field.", ge=0)] = 3,
    span: Range | None = None,
) -> dict[str, Any]:
    """The forecast for a place.

    Args:
        place: Where to look:
            a city and its country.
        unit: The unit of the temperatures.
        hours: Hours ahead, from the docstring (the Field's description wins).
    """
    return {
        "ctx": ctx,
        "place": place,
        "unit": unit,
        "mode": mode,
        "window": window,
        "hours": hours,
        "span": span,
    }


def run(item: Tool, arguments: Any, context: Any = None) -> Any:
    return asyncio.run(tool_execute(item, arguments, context))


def test_the_schema_is_built_from_the_type_hints_and_the_docstring() -> None:
    schema = forecast.parameters
    properties = schema["properties"]

    assert list(properties) == ["place", "unit", "mode", "window", "hours", "span"], "no ctx"
    assert schema["type"] == "object" and schema["required"] == ["place"]
    assert schema["additionalProperties"] is False and "title" not in schema
    assert properties["place"]["description"] == "Where to look: a city and its country."
    assert schema["$defs"]["Place"]["required"] == ["city"]
    assert schema["$defs"]["Unit"]["enum"] == ["celsius", "fahrenheit"]
    assert properties["unit"]["default"] == "celsius"
    assert properties["unit"]["description"] == "The unit of the temperatures."
    assert properties["mode"]["enum"] == ["now", "week"] and properties["mode"]["default"] == "now"
    assert schema["$defs"]["Window"]["properties"]["days"] == {
        "maximum": 7,
        "minimum": 1,
        "title": "Days",
        "type": "integer",
    }
    assert properties["hours"]["description"] == "Hours ahead, from the Field."
    assert properties["hours"]["minimum"] == 0 and properties["hours"]["type"] == "integer"
    assert schema["$defs"]["Range"]["required"] == ["low", "high"]
    # The description is the docstring without its Args section.
    assert forecast.description == "The forecast for a place."
    assert forecast.schema()["function"]["parameters"] is schema


def test_the_models_input_is_validated_and_converted_before_the_call() -> None:
    outcome = run(
        forecast,
        {
            "place": {"city": "Paris"},
            "unit": "fahrenheit",
            "window": {"days": "3"},
            "hours": "5",
            "span": {"low": 1, "high": 2},
        },
        context="the context",
    )

    assert outcome.error_text is None and outcome.failure is None
    # The tool got its objects back; its output is stored as their JSON form.
    assert outcome.output == {
        "ctx": "the context",
        "place": {"city": "Paris", "country": "FR"},
        "unit": "fahrenheit",
        "mode": "now",
        "window": {"days": 3},
        "hours": 5,
        "span": {"low": 1, "high": 2},
    }


def test_converted_values_reach_the_function_as_their_types() -> None:
    seen: dict[str, Any] = {}

    @tool
    def capture(place: Place, unit: Unit, window: Window, count: int = 1) -> str:
        seen.update(place=place, unit=unit, window=window, count=count)
        return "ok"

    outcome = run(
        capture, {"place": {"city": "Oslo"}, "unit": "celsius", "window": {"days": 2}, "count": "4"}
    )

    assert outcome.output == "ok"
    assert seen == {"place": Place("Oslo"), "unit": Unit.CELSIUS, "window": Window(days=2), "count": 4}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "place: Field required"),
        ({"place": {"city": 3}}, "place.city: Input should be a valid string"),
        ({"place": {"city": "Paris"}, "unit": "kelvin"}, "unit: Input should be 'celsius' or 'fahrenheit'"),
        (
            {"place": {"city": "Paris"}, "window": {"days": 9}},
            "window.days: Input should be less than or equal to 7",
        ),
        ({"place": {"city": "Paris"}, "hours": -1}, "hours: Input should be greater than or equal to 0"),
        ({"place": {"city": "Paris"}, "tomorrow": True}, "tomorrow: Extra inputs are not permitted"),
        ({"place": {"city": "Paris"}, "ctx": "forged"}, "ctx: Extra inputs are not permitted"),
        ("not an object", "place: Field required"),
    ],
)
def test_invalid_input_goes_back_to_the_model_as_a_tool_error_it_can_correct(
    arguments: Any, message: str
) -> None:
    outcome = run(forecast, arguments)

    assert outcome.failure is None and outcome.output is None
    assert outcome.error_text is not None
    assert outcome.error_text.startswith("Invalid input for tool forecast: ")
    assert message in outcome.error_text
    assert "errors.pydantic.dev" not in outcome.error_text, "one line, no links"
    chunk = outcome.chunk("call-1")
    assert chunk == {"type": "tool-output-error", "toolCallId": "call-1", "errorText": outcome.error_text}


def test_a_function_without_hints_still_tells_the_model_its_arguments() -> None:
    @tool
    def legacy(city, days=2):  # type: ignore[no-untyped-def]
        """Old style.

        :param city: the city
        :param days: how many
            days ahead
        :returns: a list
        """
        return [city, days]

    assert legacy.parameters == {
        "additionalProperties": False,
        "properties": {
            "city": {"description": "the city", "title": "City"},
            "days": {"default": 2, "description": "how many days ahead", "title": "Days"},
        },
        "required": ["city"],
        "type": "object",
    }
    assert legacy.description == "Old style.\n\n:returns: a list"
    assert run(legacy, {"city": "Rome"}).output == ["Rome", 2]


def test_keyword_arguments_the_schema_does_not_name_are_passed_on_to_a_var_keyword_tool() -> None:
    @tool
    def tagged(name: str, **labels: Any) -> dict[str, Any]:
        return {"name": name, **labels}

    assert tagged.parameters["additionalProperties"] is True
    assert run(tagged, {"name": "x", "colour": "red"}).output == {"name": "x", "colour": "red"}


def test_an_explicit_schema_still_works_and_passes_the_input_as_written() -> None:
    written = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    @tool(parameters=written)
    def echo(ctx: RunContext, a: int) -> Any:
        return [ctx, a]

    assert echo.parameters == written
    assert run(echo, {"a": "3"}, context="c").output == ["c", "3"], "not converted: the schema is the site's"
    assert run(echo, {"b": 1}).error_text == "Invalid input for tool echo: missing a required argument: 'a'"
    assert (
        run(echo, {"a": 1, "ctx": "forged"}).error_text
        == "Invalid input for tool echo: unexpected argument 'ctx'"
    )


def test_a_tool_error_and_an_async_typed_tool() -> None:
    @tool
    async def divide(a: float, b: float) -> float:
        if b == 0:
            raise ToolError("b must not be 0")
        return a / b

    assert run(divide, {"a": 1, "b": "4"}).output == 0.25
    assert run(divide, {"a": 1, "b": 0}).error_text == "b must not be 0"


def test_a_decorated_tool_is_still_its_function() -> None:
    assert forecast(None, Place("Nice"))["place"] == Place("Nice")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="client tool"):
        Tool(name="picker")()


def wrong_context(city: str, ctx: RunContext) -> None: ...
def star_args(*cities: str) -> None: ...
def positional(city: str, /) -> None: ...
def unresolvable(city: Undefined) -> None: ...  # type: ignore[name-defined]  # noqa: F821


class Opaque:
    pass


def opaque(thing: Opaque) -> None: ...


@pytest.mark.parametrize(
    ("func", "problem"),
    [
        (wrong_context, "RunContext must be its first parameter, not 'ctx'"),
        (star_args, "*cities: a tool is called with keyword arguments only"),
        (positional, "'city' is positional-only"),
        (unresolvable, "its type hints cannot be resolved"),
        (opaque, "pydantic cannot validate the type <class 'tests.chat.turn.test_typed_tools.Opaque'>"),
    ],
)
def test_a_schema_that_cannot_be_built_is_reported_by_check_and_refused_at_run_time(
    func: Any, problem: str
) -> None:
    broken = tool(func)
    assert broken.schema_error is not None and problem in broken.schema_error
    assert broken.parameters == {"type": "object", "properties": {}}

    cls = type("Wrong", (Think,), {"tools": [broken]})
    [error] = cls.check(label="wrong")
    assert error.id == "think_chat.E029" and problem in error.msg

    with pytest.raises(ImproperlyConfigured, match="think_chat.E029"):
        Toolset([broken])


def test_the_demo_agents_tools_are_typed_and_pass_check() -> None:
    from thinkproject.agents import Assistant, get_weather, send_email

    assert Assistant.check() == []
    assert get_weather.parameters["required"] == ["city"]
    assert get_weather.parameters["properties"]["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert send_email.signature is not None and send_email.signature.context_param == "ctx"
    assert list(send_email.parameters["properties"]) == ["to", "subject"]
    assert "to: String should match pattern" in str(
        run(send_email, {"to": "nobody", "subject": "hi"}).error_text
    )


@pytest.mark.parametrize(
    ("doc", "description", "params"),
    [
        ("Just a summary.", "Just a summary.", {}),
        (
            "Summary.\n\nMore text.\n\nArgs:\n    a (int): first\n        continued\n    b: second\n\nAfter.",
            "Summary.\n\nMore text.\n\nAfter.",
            {"a": "first continued", "b": "second"},
        ),
        (
            "Summary.\n\n:param a: first\n:type a: int\n:param b: second",
            "Summary.\n\n:type a: int",
            {"a": "first", "b": "second"},
        ),
        ("Summary.\n\nParameters:\n    **extra: anything", "Summary.", {"extra": "anything"}),
    ],
)
def test_docstring_parameters_are_read_in_google_and_sphinx_style(
    doc: str, description: str, params: dict[str, str]
) -> None:
    def func() -> None: ...

    func.__doc__ = doc
    assert docstring_parts(func) == (description, params)


def test_the_error_text_the_model_controls_is_bounded() -> None:
    """The model writes the input, so it decides how many errors there are and where: at most ten of
    them are named, each location cut at 100 characters, the whole text at 2,000."""

    @tool
    def total(numbers: list[int], labels: dict[str, int] | None = None) -> int:
        return sum(numbers)

    many = run(total, {"numbers": ["x"] * 500}).error_text
    assert many is not None and many.count("Input should be a valid integer") == 10
    assert many.endswith("; and 490 more") and len(many) < 2100
    long_keys = run(total, {"numbers": [], "labels": {"k" * 5000: "x"}}).error_text
    assert long_keys is not None and len(long_keys) < 300 and "k" * 101 not in long_keys


def test_input_that_does_not_fit_is_found_before_a_human_is_asked_to_approve_it() -> None:
    from chat.turn.tools import input_problem
    from thinkproject.agents import send_email

    assert input_problem(send_email, {"to": "a@b.c", "subject": "hi"}) is None
    problem = input_problem(send_email, {"to": "nobody", "subject": "hi"})
    assert problem is not None and problem.startswith("Invalid input for tool send_email: to: String should")
