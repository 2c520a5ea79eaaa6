"""Reattach (model_reattach), the pure parts: Responses API events to loop events and cursors, the
request conversion, and where a cursor is attached among a step's chunks.

The end-to-end proof (a SIGKILLed worker, one generation billed) is tests/e2e/test_reattach.py; the
cursor's storage is tests/recovery/test_reattach_store.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from chat.turn.llm import (
    Marked,
    ResponseCursor,
    ResponseFailed,
    StepFinish,
    TextDelta,
    ToolCallDelta,
    Usage,
    _ResponseEvents,
    response_input,
    response_tools,
)
from chat.turn.loop import ModelLoop

RID = "resp_1"


def created(seq: int = 0) -> dict[str, Any]:
    return {"type": "response.created", "sequence_number": seq, "response": {"id": RID, "status": "queued"}}


def translate_all(events: list[dict[str, Any]], translator: _ResponseEvents | None = None) -> list[Any]:
    translator = translator or _ResponseEvents()
    return [out for event in events for out in translator.translate(event)]


def test_text_deltas_carry_the_cursor_after_them() -> None:
    out = translate_all(
        [
            created(0),
            {"type": "response.in_progress", "sequence_number": 1, "response": {"id": RID}},
            {
                "type": "response.output_item.added",
                "sequence_number": 2,
                "output_index": 0,
                "item": {"type": "message"},
            },
            {"type": "response.output_text.delta", "sequence_number": 3, "delta": "1"},
            {"type": "response.output_text.delta", "sequence_number": 4, "delta": " 2"},
            {"type": "response.output_item.done", "sequence_number": 5, "output_index": 0, "item": {}},
            {
                "type": "response.completed",
                "sequence_number": 6,
                "response": {
                    "id": RID,
                    "output": [{"type": "message"}],
                    "usage": {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9},
                },
            },
        ]
    )
    assert out == [
        Marked(None, ResponseCursor(RID, 0)),
        Marked(None, ResponseCursor(RID, 1)),
        Marked(TextDelta("1"), ResponseCursor(RID, 3)),
        Marked(TextDelta(" 2"), ResponseCursor(RID, 4)),
        Marked(None, ResponseCursor(RID, 5)),
        Usage(7, 2, 9),
        Marked(StepFinish("stop"), ResponseCursor(RID, 6, done=True)),
    ]


def test_a_tool_call_is_only_marked_once_it_is_whole() -> None:
    """A resume never starts inside a call: its pieces carry no cursor, its completion does."""
    out = translate_all(
        [
            created(0),
            {
                "type": "response.output_item.added",
                "sequence_number": 1,
                "output_index": 0,
                "item": {
                    "type": "function_call",
                    "call_id": "call_a",
                    "name": "get_weather",
                    "arguments": "",
                },
            },
            {
                "type": "response.function_call_arguments.delta",
                "sequence_number": 2,
                "output_index": 0,
                "delta": '{"city"',
            },
            {
                "type": "response.function_call_arguments.delta",
                "sequence_number": 3,
                "output_index": 0,
                "delta": ': "Oslo"}',
            },
            {"type": "response.output_item.done", "sequence_number": 4, "output_index": 0, "item": {}},
            {"type": "response.completed", "sequence_number": 5, "response": {"id": RID, "output": []}},
        ]
    )
    assert out == [
        Marked(None, ResponseCursor(RID, 0)),
        ToolCallDelta(0, "call_a", "get_weather", ""),
        ToolCallDelta(0, None, None, '{"city"'),
        ToolCallDelta(0, None, None, ': "Oslo"}'),
        Marked(None, ResponseCursor(RID, 4)),
        Marked(StepFinish("tool_calls"), ResponseCursor(RID, 5, done=True)),
    ]


def test_a_resumed_stream_knows_its_response_without_a_created_event() -> None:
    out = translate_all(
        [{"type": "response.output_text.delta", "sequence_number": 41, "delta": " 9"}], _ResponseEvents(RID)
    )
    assert out == [Marked(TextDelta(" 9"), ResponseCursor(RID, 41))]


def test_typed_events_work_like_dicts() -> None:
    class Event:
        type = "response.output_text.delta"
        sequence_number = 3
        delta = "x"

    assert translate_all([Event()], _ResponseEvents(RID)) == [Marked(TextDelta("x"), ResponseCursor(RID, 3))]  # type: ignore[list-item]


def test_an_incomplete_response_finishes_with_length() -> None:
    out = translate_all(
        [
            created(),
            {"type": "response.incomplete", "sequence_number": 1, "response": {"id": RID, "output": []}},
        ]
    )
    assert out[-1] == Marked(StepFinish("length"), ResponseCursor(RID, 1, done=True))


@pytest.mark.parametrize(
    "event",
    [
        {"type": "response.failed", "sequence_number": 3, "response": {"error": {"message": "overloaded"}}},
        {"type": "error", "sequence_number": 3, "message": "overloaded"},
    ],
)
def test_a_failed_response_raises(event: dict[str, Any]) -> None:
    with pytest.raises(ResponseFailed, match="overloaded"):
        translate_all([created(), event])


def test_chat_messages_become_instructions_and_input_items() -> None:
    instructions, items = response_input(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "Looking.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"a":1}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "user", "content": [{"type": "text", "text": "thanks"}]},
        ]
    )
    assert instructions == "Be brief."
    assert items == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Looking."},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"a":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": "thanks"},
    ]
    schema = {"type": "object", "properties": {}}
    assert response_tools(
        [{"type": "function", "function": {"name": "w", "description": "d", "parameters": schema}}]
    ) == [{"type": "function", "name": "w", "parameters": schema, "description": "d"}]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"responseId": RID, "sequenceNumber": 4, "done": False}, ResponseCursor(RID, 4)),
        ({"responseId": RID, "sequenceNumber": 9, "done": True}, ResponseCursor(RID, 9, True)),
        ({"responseId": "", "sequenceNumber": 4}, None),
        ({"responseId": RID, "sequenceNumber": "4"}, None),
        ({"responseId": RID}, None),
        (None, None),
        ("resp_1", None),
    ],
)
def test_a_cursor_from_a_snapshot(data: Any, expected: ResponseCursor | None) -> None:
    assert ResponseCursor.from_json(data) == expected
    if expected is not None:
        assert ResponseCursor.from_json(expected.as_json()) == expected


async def test_the_cursor_goes_with_the_last_chunk_of_its_event() -> None:
    """Stored with the event's last chunk, never before it (a crash would lose the chunk) nor after it
    (a resume would repeat it); an event without chunks leaves the cursor for the next write."""
    sent: list[tuple[str, Any]] = []
    noted: list[Any] = []

    async def emit(chunk: dict[str, Any], cursor: dict[str, Any] | None = None) -> None:
        sent.append((chunk["type"], cursor))

    loop = ModelLoop.__new__(ModelLoop)
    loop.emit, loop.note_cursor = emit, noted.append
    cursor = ResponseCursor(RID, 7)
    await loop._emit_all([{"type": "text-start"}, {"type": "text-delta"}], cursor)
    await loop._emit_all([], ResponseCursor(RID, 8))
    await loop._emit_all([{"type": "text-delta"}])
    assert sent == [("text-start", None), ("text-delta", cursor.as_json()), ("text-delta", None)]
    assert noted == [ResponseCursor(RID, 8).as_json()]


async def test_only_reattach_calls_go_to_the_responses_api(scripted_model: Any) -> None:
    """Registering the scripted model with litellm (so its Responses streams are real) must not send
    ordinary chat completions through litellm's Responses bridge."""
    from chat.turn import llm
    from think_scripted.kwargs import litellm_kwargs as scripted_kwargs

    model = {**scripted_kwargs(), "api_base": scripted_model.url}
    created = scripted_model.responses_created
    messages = [{"role": "user", "content": "count to 3"}]
    chat_text = "".join(
        [e.text async for e in llm.stream_chat(model=model, messages=messages) if isinstance(e, TextDelta)]
    )
    assert chat_text == "1 2 3" and scripted_model.responses_created == created

    events = [e async for e in llm.stream_response(model=model, messages=messages)]
    text = "".join(e.event.text for e in events if isinstance(e, Marked) and isinstance(e.event, TextDelta))
    assert text == "1 2 3" and scripted_model.responses_created == created + 1
    last = events[-1]
    assert isinstance(last, Marked) and last.event == StepFinish("stop") and last.cursor.done


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("server_error", "transient"),
        ("rate_limit_exceeded", "rate_limit"),
        ("invalid_prompt", None),
        (None, None),
    ],
)
def test_a_failed_generation_is_classified_by_its_code(code: str | None, kind: str | None) -> None:
    from chat.turn.errors import default_chat_error_classifier

    event = {
        "type": "response.failed",
        "sequence_number": 2,
        "response": {"error": {"message": "no", "code": code}},
    }
    with pytest.raises(ResponseFailed) as failed:
        translate_all([created(), event])
    assert failed.value.code == code
    assert default_chat_error_classifier(failed.value) == kind


async def test_a_resume_the_provider_cannot_serve_says_why(scripted_model: Any) -> None:
    """Unknown to the provider: not_found; the provider unreachable or refusing: unavailable. Either
    way the loop falls back to an ordinary continuation, never ends the turn."""
    from chat.exceptions import ReattachUnavailable
    from chat.turn import llm
    from tests.support import free_port
    from think_scripted.kwargs import litellm_kwargs as scripted_kwargs

    model = {**scripted_kwargs(), "api_base": scripted_model.url}
    cursor = ResponseCursor("resp_never_made", 3)
    with pytest.raises(ReattachUnavailable) as missing:
        [e async for e in llm.stream_response(model=model, messages=[], resume=cursor)]
    assert missing.value.reason == "not_found"

    closed = {**model, "api_base": f"http://127.0.0.1:{free_port()}/v1"}
    with pytest.raises(ReattachUnavailable) as down:
        [e async for e in llm.stream_response(model=closed, messages=[], resume=cursor)]
    assert down.value.reason == "unavailable"
