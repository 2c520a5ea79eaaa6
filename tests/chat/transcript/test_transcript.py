"""to_model_messages: a UIMessage transcript as chat-completions messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from chat.transcript.model_messages import to_model_messages
from tests.files import data_url, png


def user(text: str, message_id: str = "u") -> dict[str, Any]:
    return {"id": message_id, "role": "user", "parts": [{"type": "text", "text": text}]}


def assistant(*parts: dict[str, Any], message_id: str = "a") -> dict[str, Any]:
    return {"id": message_id, "role": "assistant", "parts": list(parts)}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value, "state": "done"}


STEP = {"type": "step-start"}


def tool(state: str, *, call_id: str = "call_1", name: str = "getWeather", **fields: Any) -> dict[str, Any]:
    return {
        "type": f"tool-{name}",
        "toolCallId": call_id,
        "state": state,
        "input": {"city": "Paris"},
        **fields,
    }


def call(call_id: str = "call_1", name: str = "getWeather", arguments: Any = None) -> dict[str, Any]:
    args = {"city": "Paris"} if arguments is None else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def test_empty_transcript() -> None:
    assert to_model_messages([]) == []


def test_system_prompt_comes_first() -> None:
    assert to_model_messages([user("hi")], system_prompt="Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


@pytest.mark.parametrize("prompt", [None, ""])
def test_no_system_message_without_a_prompt(prompt: str | None) -> None:
    assert to_model_messages([user("hi")], system_prompt=prompt) == [{"role": "user", "content": "hi"}]


def test_user_text_parts_are_joined_and_other_parts_ignored() -> None:
    message = {
        "id": "u",
        "role": "user",
        "parts": [
            {"type": "text", "text": "Look at "},
            {"type": "text", "text": "this."},
            {"type": "data-x", "data": {"text": "not me"}},
        ],
    }
    assert to_model_messages([message]) == [{"role": "user", "content": "Look at this."}]


def test_a_file_stored_inline_still_reaches_the_model_and_a_broken_one_is_named() -> None:
    """Messages stored before files were kept apart (chat.transcript.files) hold data URLs: checked as
    a new file is (bytes that are not what they claim are left out)."""
    broken = {"type": "file", "url": "data:image/png;base64,@@", "mediaType": "image/png", "filename": "x"}
    lying = {
        "type": "file",
        "url": data_url("image/png", b"<html>"),
        "mediaType": "image/png",
        "filename": "y",
    }
    message = {
        "id": "u",
        "role": "user",
        "parts": [
            {"type": "text", "text": "Look at "},
            {"type": "file", "url": data_url("image/png", PNG), "mediaType": "image/png"},
            broken,
            lying,
            {"type": "data-x", "data": {"text": "not me"}},
        ],
    }
    assert to_model_messages([message]) == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look at "},
                {"type": "image_url", "image_url": {"url": data_url("image/png", PNG)}},
                {"type": "text", "text": "[The file x is no longer available.]"},
                {"type": "text", "text": "[The file y is no longer available.]"},
            ],
        }
    ]


def test_the_newest_files_fill_a_model_call_and_older_ones_are_named() -> None:
    """One 100-byte budget, three files of 60 bytes: the newest goes, the two before it are named."""
    files = [
        {"type": "file", "url": data_url("text/plain", bytes([97 + i]) * 60), "filename": f"f{i}"}
        for i in range(3)
    ]
    messages = [
        {"id": "u1", "role": "user", "parts": files[:2]},
        {"id": "u2", "role": "user", "parts": [files[2]]},
    ]
    first, second = to_model_messages(messages, max_file_bytes=100)
    assert [p["text"] for p in first["content"]] == [
        f"[The file f{i} is left out: newer files fill this request.]" for i in range(2)
    ]
    assert second["content"] == [{"type": "text", "text": "[File f2 (text/plain)]\n" + "c" * 60}]
    assert all("left out" not in p["text"] for m in to_model_messages(messages) for p in m["content"])


PNG = png()


def test_user_message_without_parts() -> None:
    assert to_model_messages([{"id": "u", "role": "user", "parts": []}]) == [{"role": "user", "content": ""}]
    assert to_model_messages([{"id": "u", "role": "user"}]) == [{"role": "user", "content": ""}]


def test_system_messages_in_the_transcript_keep_their_role() -> None:
    message = {"id": "s", "role": "system", "parts": [{"type": "text", "text": "Rules."}]}
    assert to_model_messages([message], system_prompt="P") == [
        {"role": "system", "content": "P"},
        {"role": "system", "content": "Rules."},
    ]


def test_conversation_order_is_kept() -> None:
    messages = [user("one", "u1"), assistant(STEP, text("two")), user("three", "u2")]
    assert to_model_messages(messages) == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ]


def test_assistant_text_parts_are_joined_and_reasoning_dropped() -> None:
    message = assistant(
        STEP,
        {"type": "reasoning", "text": "secret", "state": "done"},
        text("Hello, "),
        text("world"),
    )
    assert to_model_messages([message]) == [{"role": "assistant", "content": "Hello, world"}]


def test_settled_tool_part_becomes_tool_calls_then_a_tool_message() -> None:
    message = assistant(STEP, text("Let me check."), tool("output-available", output="Sunny, 21C"))
    assert to_model_messages([user("weather?"), message]) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21C"},
    ]


def test_tool_call_without_text_has_null_content() -> None:
    message = assistant(STEP, tool("output-available", output="ok"))
    assert to_model_messages([message]) == [
        {"role": "assistant", "content": None, "tool_calls": [call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ]


@pytest.mark.parametrize(
    ("output", "content"),
    [
        ("plain string", "plain string"),
        ('{"already": "json"}', '{"already": "json"}'),
        ("", ""),
        ({"temp": 21, "unit": "C"}, '{"temp": 21, "unit": "C"}'),
        ([1, "two", None], '[1, "two", null]'),
        (42, "42"),
        (True, "true"),
        (None, "null"),
    ],
)
def test_tool_output_text(output: Any, content: str) -> None:
    result = to_model_messages([assistant(STEP, tool("output-available", output=output))])
    assert result[-1] == {"role": "tool", "tool_call_id": "call_1", "content": content}
    if not isinstance(output, str):
        assert json.loads(result[-1]["content"]) == output


def test_output_error_text() -> None:
    result = to_model_messages([assistant(STEP, tool("output-error", errorText="timed out"))])
    assert result[0]["tool_calls"] == [call()]
    assert result[1] == {"role": "tool", "tool_call_id": "call_1", "content": "Error: timed out"}


def test_output_error_without_text() -> None:
    result = to_model_messages([assistant(STEP, tool("output-error"))])
    assert result[1]["content"] == "Error: "


def test_output_denied_text() -> None:
    part = tool("output-denied", approval={"id": "ap_1", "approved": False})
    result = to_model_messages([assistant(STEP, part)])
    assert result == [
        {"role": "assistant", "content": None, "tool_calls": [call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "The user denied this tool call."},
    ]


@pytest.mark.parametrize(
    "state", ["input-streaming", "input-available", "approval-requested", "approval-responded"]
)
def test_unsettled_tool_parts_are_left_out(state: str) -> None:
    message = assistant(STEP, text("Checking."), tool(state, approval={"id": "ap"}))
    assert to_model_messages([message]) == [{"role": "assistant", "content": "Checking."}]


def test_message_with_only_an_unsettled_tool_part_gives_nothing() -> None:
    assert to_model_messages([user("q"), assistant(STEP, tool("input-available"))]) == [
        {"role": "user", "content": "q"}
    ]


def test_step_start_splits_steps() -> None:
    message = assistant(
        STEP,
        text("Let me check."),
        tool("output-available", output="Sunny"),
        STEP,
        text("It is sunny in Paris."),
    )
    assert to_model_messages([message]) == [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call()]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ]


def test_parallel_tool_calls_in_one_step() -> None:
    message = assistant(
        STEP,
        tool("output-available", call_id="a", name="one", output="A"),
        tool("output-error", call_id="b", name="two", errorText="x"),
        tool("input-available", call_id="c", name="three"),
        STEP,
        text("Done."),
    )
    assert to_model_messages([message]) == [
        {"role": "assistant", "content": None, "tool_calls": [call("a", "one"), call("b", "two")]},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "b", "content": "Error: x"},
        {"role": "assistant", "content": "Done."},
    ]


def test_empty_steps_are_skipped() -> None:
    assert to_model_messages([assistant(STEP, STEP, text("x"), STEP)]) == [
        {"role": "assistant", "content": "x"}
    ]


def test_tool_input_is_json_encoded_and_missing_input_is_an_empty_object() -> None:
    with_input = tool("output-available", output="r")
    with_input["input"] = {"q": "日本", "n": [1, 2]}
    without_input = tool("output-available", call_id="c2", output="r")
    without_input["input"] = None
    result = to_model_messages([assistant(STEP, with_input, without_input)])
    arguments = [c["function"]["arguments"] for c in result[0]["tool_calls"]]
    assert json.loads(arguments[0]) == {"q": "日本", "n": [1, 2]}
    assert arguments[1] == "{}"


def test_dynamic_tool_uses_its_tool_name() -> None:
    part = {
        "type": "dynamic-tool",
        "toolName": "mcp_search",
        "toolCallId": "d1",
        "state": "output-available",
        "input": {},
        "output": {"hits": 0},
    }
    assert to_model_messages([assistant(STEP, part)]) == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "d1", "type": "function", "function": {"name": "mcp_search", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "d1", "content": '{"hits": 0}'},
    ]


def test_every_tool_call_is_answered_by_a_tool_message() -> None:
    messages = [
        user("go"),
        assistant(
            STEP,
            tool("output-available", call_id="x1", output=1),
            STEP,
            tool("output-denied", call_id="x2"),
            tool("output-error", call_id="x3", errorText="e"),
            STEP,
            text("end"),
        ),
    ]
    result = to_model_messages(messages)
    called = [c["id"] for m in result if m["role"] == "assistant" for c in m.get("tool_calls", [])]
    answered = [m["tool_call_id"] for m in result if m["role"] == "tool"]
    assert called == answered == ["x1", "x2", "x3"]


def test_no_assistant_message_with_null_content_and_no_tool_calls() -> None:
    partial = assistant(STEP, {"type": "text", "text": "", "state": "streaming"})
    for message in to_model_messages([user("hi"), partial, user("again", "u2")]):
        if message["role"] == "assistant":
            assert message["content"] is not None or message.get("tool_calls")
