"""UIChunker: chat/llm.py events -> AI SDK UI chunks, and the fold of those chunks."""

from __future__ import annotations

from typing import Any

import pytest

from chat.transcript.folding import MessageAccumulator
from chat.turn.chunking import UIChunker
from chat.turn.llm import Event, ReasoningDelta, StepFinish, TextDelta, ToolCallDelta, Usage


def run(
    events: list[Event], *, message_id: str = "m-1", metadata: dict[str, Any] | None = None
) -> list[dict]:
    chunker = UIChunker(message_id)
    chunks = chunker.begin(metadata=metadata)
    for event in events:
        chunks += chunker.feed(event)
    return chunks + chunker.end()


def folded(chunks: list[dict[str, Any]], message_id: str = "placeholder") -> MessageAccumulator:
    accumulator = MessageAccumulator(message_id)
    for chunk in chunks:
        accumulator.apply(chunk)
    return accumulator


def assert_well_formed(chunks: list[dict[str, Any]]) -> None:
    """The stream rules ai@7 enforces: deltas inside an open part, every part closed, start/finish framing."""
    assert chunks[0]["type"] == "start" and chunks[1] == {"type": "start-step"}
    assert [c["type"] for c in chunks[-2:]] == ["finish-step", "finish"]
    open_blocks: set[tuple[str, str]] = set()
    seen_blocks: set[tuple[str, str]] = set()
    tool_calls: dict[str, str] = {}
    for chunk in chunks[2:-2]:
        kind, _, phase = chunk["type"].rpartition("-")
        if kind in ("text", "reasoning"):
            key = (kind, chunk["id"])
            if phase == "start":
                assert key not in seen_blocks, f"part id reused: {key}"
                open_blocks.add(key)
                seen_blocks.add(key)
            elif phase == "delta":
                assert key in open_blocks, f"delta outside an open part: {chunk}"
            else:
                assert key in open_blocks, f"end of a part that is not open: {chunk}"
                open_blocks.discard(key)
        elif chunk["type"] == "tool-input-start":
            assert chunk["toolCallId"] not in tool_calls
            tool_calls[chunk["toolCallId"]] = "streaming"
        elif chunk["type"] == "tool-input-delta":
            assert tool_calls.get(chunk["toolCallId"]) == "streaming"
        elif chunk["type"] in ("tool-input-available", "tool-input-error"):
            assert tool_calls.get(chunk["toolCallId"]) == "streaming"
            tool_calls[chunk["toolCallId"]] = "done"
    assert not open_blocks, f"parts left open: {open_blocks}"
    assert all(state == "done" for state in tool_calls.values()), tool_calls


# -- begin / text / reasoning --------------------------------------------------------------------------
def test_begin() -> None:
    assert UIChunker("m-1").begin() == [{"type": "start", "messageId": "m-1"}, {"type": "start-step"}]


def test_begin_with_metadata() -> None:
    assert UIChunker("m-1").begin(metadata={"model": "x"}) == [
        {"type": "start", "messageId": "m-1", "messageMetadata": {"model": "x"}},
        {"type": "start-step"},
    ]


def test_text_deltas_open_one_part_and_reuse_its_id() -> None:
    chunker = UIChunker("m")
    first = chunker.feed(TextDelta("Hel"))
    second = chunker.feed(TextDelta("lo"))
    assert first == [{"type": "text-start", "id": "t1"}, {"type": "text-delta", "id": "t1", "delta": "Hel"}]
    assert second == [{"type": "text-delta", "id": "t1", "delta": "lo"}]


def test_reasoning_deltas() -> None:
    chunker = UIChunker("m")
    assert chunker.feed(ReasoningDelta("a")) == [
        {"type": "reasoning-start", "id": "r1"},
        {"type": "reasoning-delta", "id": "r1", "delta": "a"},
    ]
    assert chunker.feed(ReasoningDelta("b")) == [{"type": "reasoning-delta", "id": "r1", "delta": "b"}]


def test_switching_reasoning_to_text_closes_the_reasoning_part() -> None:
    chunker = UIChunker("m")
    chunker.feed(ReasoningDelta("think"))
    assert chunker.feed(TextDelta("say")) == [
        {"type": "reasoning-end", "id": "r1"},
        {"type": "text-start", "id": "t2"},
        {"type": "text-delta", "id": "t2", "delta": "say"},
    ]


def test_switching_text_to_reasoning_closes_the_text_part_and_ids_stay_unique() -> None:
    chunker = UIChunker("m")
    chunks = chunker.feed(TextDelta("a")) + chunker.feed(ReasoningDelta("b")) + chunker.feed(TextDelta("c"))
    assert chunks == [
        {"type": "text-start", "id": "t1"},
        {"type": "text-delta", "id": "t1", "delta": "a"},
        {"type": "text-end", "id": "t1"},
        {"type": "reasoning-start", "id": "r2"},
        {"type": "reasoning-delta", "id": "r2", "delta": "b"},
        {"type": "reasoning-end", "id": "r2"},
        {"type": "text-start", "id": "t3"},
        {"type": "text-delta", "id": "t3", "delta": "c"},
    ]


def test_usage_event_emits_nothing() -> None:
    chunker = UIChunker("m")
    assert chunker.feed(Usage(1, 2, 3)) == []
    assert chunker.usage == Usage(1, 2, 3)


# -- step finish ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("provider", "ui"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("tool_calls", "tool-calls"),
        ("content_filter", "content-filter"),
        ("function_call", "other"),
        ("end_turn", "other"),
        ("", "other"),
    ],
)
def test_step_finish_maps_finish_reasons(provider: str, ui: str) -> None:
    chunker = UIChunker("m")
    chunker.feed(StepFinish(provider))
    assert chunker.finish_reason == ui
    assert chunker.end()[-1] == {"type": "finish", "finishReason": ui}


def test_step_finish_closes_the_open_part() -> None:
    chunker = UIChunker("m")
    chunker.feed(TextDelta("x"))
    assert chunker.feed(StepFinish("stop")) == [{"type": "text-end", "id": "t1"}]
    assert chunker.end() == [{"type": "finish-step"}, {"type": "finish", "finishReason": "stop"}]


def test_end_without_step_finish_defaults_to_stop_and_closes_parts() -> None:
    chunker = UIChunker("m")
    chunker.feed(ReasoningDelta("x"))
    assert chunker.end() == [
        {"type": "reasoning-end", "id": "r1"},
        {"type": "finish-step"},
        {"type": "finish", "finishReason": "stop"},
    ]


def test_end_with_usage_puts_it_in_message_metadata() -> None:
    chunker = UIChunker("m")
    chunker.feed(StepFinish("stop"))
    chunker.feed(Usage(prompt_tokens=12, completion_tokens=5, total_tokens=17))
    assert chunker.end()[-1] == {
        "type": "finish",
        "finishReason": "stop",
        "messageMetadata": {
            "usage": {"promptTokens": 12, "completionTokens": 5, "totalTokens": 17, "cachedTokens": 0}
        },
    }


def test_end_without_usage_has_no_message_metadata() -> None:
    assert "messageMetadata" not in UIChunker("m").end()[-1]


# -- tool calls ---------------------------------------------------------------------------------------------
def test_tool_call_deltas_then_input_available_at_step_finish() -> None:
    chunker = UIChunker("m")
    first = chunker.feed(ToolCallDelta(0, "call_1", "getWeather", '{"city":'))
    assert first == [
        {"type": "tool-input-start", "toolCallId": "call_1", "toolName": "getWeather"},
        {"type": "tool-input-delta", "toolCallId": "call_1", "inputTextDelta": '{"city":'},
    ]
    assert chunker.tool_calls_pending
    second = chunker.feed(ToolCallDelta(0, None, None, '"Paris"}'))
    assert second == [{"type": "tool-input-delta", "toolCallId": "call_1", "inputTextDelta": '"Paris"}'}]
    assert chunker.feed(StepFinish("tool_calls")) == [
        {
            "type": "tool-input-available",
            "toolCallId": "call_1",
            "toolName": "getWeather",
            "input": {"city": "Paris"},
        }
    ]
    assert not chunker.tool_calls_pending
    assert chunker.end() == [{"type": "finish-step"}, {"type": "finish", "finishReason": "tool-calls"}]


def test_tool_call_without_arguments_delta_has_empty_object_input() -> None:
    chunker = UIChunker("m")
    assert chunker.feed(ToolCallDelta(0, "c", "ping", "")) == [
        {"type": "tool-input-start", "toolCallId": "c", "toolName": "ping"}
    ]
    assert chunker.feed(StepFinish("tool_calls")) == [
        {"type": "tool-input-available", "toolCallId": "c", "toolName": "ping", "input": {}}
    ]


def test_tool_call_without_id_gets_a_stable_generated_id() -> None:
    chunker = UIChunker("msg-9")
    chunks = chunker.feed(ToolCallDelta(2, None, "f", "{}"))
    call_id = chunks[0]["toolCallId"]
    assert call_id.startswith("call_")
    assert chunks[0] == {"type": "tool-input-start", "toolCallId": call_id, "toolName": "f"}
    assert chunker.feed(ToolCallDelta(2, None, None, "")) == []
    assert chunker.feed(StepFinish("tool_calls"))[0]["toolCallId"] == call_id


def test_generated_tool_call_ids_never_repeat_across_steps_or_continuations() -> None:
    """A continuation extends the same message: an id from the message id and index would repeat."""
    ids = set()
    for _ in range(3):  # a step, the next one, and a continuation of the same message
        chunker = UIChunker("msg-9")
        ids.add(chunker.feed(ToolCallDelta(0, None, "f", "{}"))[0]["toolCallId"])
        chunker.feed(StepFinish("tool_calls"))
    assert len(ids) == 3


def test_tool_call_without_name() -> None:
    chunker = UIChunker("m")
    assert chunker.feed(ToolCallDelta(0, "c", None, ""))[0]["toolName"] == ""


@pytest.mark.parametrize("arguments", ['{"city": "Par', "[1, 2]", '"text"', "42", "null", "not json"])
def test_tool_call_with_invalid_arguments_is_an_input_error(arguments: str) -> None:
    chunker = UIChunker("m")
    chunker.feed(ToolCallDelta(0, "c", "getWeather", arguments))
    assert chunker.feed(StepFinish("tool_calls")) == [
        {
            "type": "tool-input-error",
            "toolCallId": "c",
            "toolName": "getWeather",
            "input": arguments,
            "errorText": "The model produced tool input that is not a JSON object.",
        }
    ]


def test_tool_call_closes_the_open_text_part() -> None:
    chunker = UIChunker("m")
    chunker.feed(TextDelta("Let me check."))
    assert chunker.feed(ToolCallDelta(0, "c", "f", "")) == [
        {"type": "text-end", "id": "t1"},
        {"type": "tool-input-start", "toolCallId": "c", "toolName": "f"},
    ]


def test_parallel_tool_calls_by_index() -> None:
    chunker = UIChunker("m")
    chunker.feed(ToolCallDelta(0, "a", "one", '{"x":'))
    chunker.feed(ToolCallDelta(1, "b", "two", '{"y":2}'))
    chunker.feed(ToolCallDelta(0, None, None, "1}"))
    assert chunker.feed(StepFinish("tool_calls")) == [
        {"type": "tool-input-available", "toolCallId": "a", "toolName": "one", "input": {"x": 1}},
        {"type": "tool-input-available", "toolCallId": "b", "toolName": "two", "input": {"y": 2}},
    ]


def test_end_flushes_tool_calls_still_pending() -> None:
    chunker = UIChunker("m")
    chunker.feed(ToolCallDelta(0, "c", "f", '{"a":1}'))
    assert chunker.end() == [
        {"type": "tool-input-available", "toolCallId": "c", "toolName": "f", "input": {"a": 1}},
        {"type": "finish-step"},
        {"type": "finish", "finishReason": "stop"},
    ]


# -- the chunker's output folds into the message the worker persists ---------------------------------
def test_text_only_turn_folds_to_the_ui_message() -> None:
    chunks = run([TextDelta("Hello"), TextDelta(", world"), StepFinish("stop")], message_id="asst-1")
    assert_well_formed(chunks)
    accumulator = folded(chunks)
    assert accumulator.message() == {
        "id": "asst-1",
        "role": "assistant",
        "parts": [{"type": "step-start"}, {"type": "text", "text": "Hello, world", "state": "done"}],
    }
    assert accumulator.finish_reason == "stop"


def test_reasoning_text_tool_turn_folds_with_usage() -> None:
    events: list[Event] = [
        ReasoningDelta("The user wants "),
        ReasoningDelta("weather."),
        TextDelta("Let me "),
        TextDelta("check."),
        ToolCallDelta(0, "call_1", "getWeather", '{"city":'),
        ToolCallDelta(0, None, None, ' "Paris"}'),
        StepFinish("tool_calls"),
        Usage(20, 10, 30),
    ]
    chunks = run(events, message_id="asst-2", metadata={"agent": "assistant"})
    assert_well_formed(chunks)
    accumulator = folded(chunks)
    assert accumulator.message() == {
        "id": "asst-2",
        "role": "assistant",
        "metadata": {
            "agent": "assistant",
            "usage": {"promptTokens": 20, "completionTokens": 10, "totalTokens": 30, "cachedTokens": 0},
        },
        "parts": [
            {"type": "step-start"},
            {"type": "reasoning", "text": "The user wants weather.", "state": "done"},
            {"type": "text", "text": "Let me check.", "state": "done"},
            {
                "type": "tool-getWeather",
                "toolCallId": "call_1",
                "state": "input-available",
                "input": {"city": "Paris"},
            },
        ],
    }
    assert accumulator.finish_reason == "tool-calls"
    assert not accumulator.has_settled_tool_results


def test_invalid_tool_input_folds_to_an_output_error_part() -> None:
    chunks = run([ToolCallDelta(0, "c", "calc", "{oops"), StepFinish("tool_calls")])
    assert_well_formed(chunks)
    accumulator = folded(chunks)
    assert accumulator.parts[-1] == {
        "type": "tool-calc",
        "toolCallId": "c",
        "state": "output-error",
        "input": "{oops",
        "errorText": "The model produced tool input that is not a JSON object.",
    }


def test_empty_turn_folds_to_a_message_without_content() -> None:
    chunks = run([StepFinish("stop")])
    assert chunks == [
        {"type": "start", "messageId": "m-1"},
        {"type": "start-step"},
        {"type": "finish-step"},
        {"type": "finish", "finishReason": "stop"},
    ]
    accumulator = folded(chunks)
    assert accumulator.parts == [{"type": "step-start"}]
    assert not accumulator.has_content


SCRIPTS: list[list[Event]] = [
    [],
    [TextDelta("a")],
    [ReasoningDelta("a")],
    [ReasoningDelta("a"), TextDelta("b"), ReasoningDelta("c"), TextDelta("d")],
    [TextDelta("a"), StepFinish("length")],
    [TextDelta("a"), ToolCallDelta(0, "x", "f", "{}"), TextDelta("after"), StepFinish("tool_calls")],
    [
        ToolCallDelta(0, None, "f", '{"a"'),
        ToolCallDelta(1, None, "g", "{}"),
        ToolCallDelta(0, None, None, ":1}"),
    ],
    [ReasoningDelta("r"), ToolCallDelta(0, "x", "f", "[]"), Usage(1, 1, 2)],
    [TextDelta('line\nbreak "quoted" 🙂'), StepFinish("content_filter"), Usage(3, 4, 7)],
]


@pytest.mark.parametrize("events", SCRIPTS)
def test_chunker_output_is_well_formed_and_folds_to_settled_parts(events: list[Event]) -> None:
    chunks = run(events, message_id="asst-x")
    assert_well_formed(chunks)
    accumulator = folded(chunks)
    assert accumulator.message_id == "asst-x"
    assert accumulator.parts[0] == {"type": "step-start"}
    blocks = [p for p in accumulator.parts if p["type"] in ("text", "reasoning")]
    assert all(p["state"] == "done" for p in blocks)
    tools = [p for p in accumulator.parts if p["type"].startswith("tool-")]
    assert all(p["state"] in ("input-available", "output-error") for p in tools)
    expected_text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert accumulator.text == expected_text
    expected_reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert "".join(p["text"] for p in blocks if p["type"] == "reasoning") == expected_reasoning
