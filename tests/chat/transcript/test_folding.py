"""Folding AI SDK UI chunks into a UIMessage (MessageAccumulator, fold_bodies)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from chat.transcript.folding import (
    MessageAccumulator,
    fold_bodies,
    is_settled_tool_part,
    is_tool_part,
    message_chunks,
    tool_name_of,
)


def fold(*chunks: dict[str, Any], message_id: str = "m-1") -> MessageAccumulator:
    accumulator = MessageAccumulator(message_id)
    for chunk in chunks:
        accumulator.apply(chunk)
    return accumulator


# -- the full stream ----------------------------------------------------------------------------------------
REALISTIC_STREAM = [
    {"type": "start", "messageId": "asst-_7m9oTQg"},
    {"type": "start-step"},
    {"type": "text-start", "id": "t1"},
    {"type": "text-delta", "id": "t1", "delta": "one "},
    {"type": "text-delta", "id": "t1", "delta": "two "},
    {"type": "text-delta", "id": "t1", "delta": "three"},
    {"type": "text-end", "id": "t1"},
    {"type": "finish-step"},
    {"type": "finish"},
]


def test_folding_a_realistic_stream_gives_the_ui_message() -> None:
    accumulator = fold(*REALISTIC_STREAM, message_id="placeholder")
    assert accumulator.message() == {
        "id": "asst-_7m9oTQg",
        "role": "assistant",
        "parts": [{"type": "step-start"}, {"type": "text", "text": "one two three", "state": "done"}],
    }
    assert accumulator.text == "one two three"
    assert accumulator.has_content
    assert not accumulator.has_settled_tool_results
    assert accumulator.error_text is None


def test_fold_bodies_matches_apply() -> None:
    bodies = [json.dumps(c, separators=(",", ":")) for c in REALISTIC_STREAM]
    assert fold_bodies("placeholder", bodies).message() == fold(*REALISTIC_STREAM).message()


def test_fold_bodies_skips_malformed_bodies() -> None:
    bodies = [json.dumps(c) for c in REALISTIC_STREAM]
    bodies[3:3] = ["", "not json", "[1, 2]", "null", '"text-delta"', "42", '{"type": 5}', '{"no": "type"}']
    accumulator = fold_bodies("placeholder", bodies)
    assert accumulator.message() == fold(*REALISTIC_STREAM).message()


def test_fold_bodies_of_nothing() -> None:
    accumulator = fold_bodies("m-9", [])
    assert accumulator.message() == {"id": "m-9", "role": "assistant", "parts": []}
    assert not accumulator.has_content


def test_apply_body_skips_malformed_json() -> None:
    accumulator = MessageAccumulator("m")
    accumulator.apply_body("{broken")
    accumulator.apply_body("[]")
    accumulator.apply_body('{"type":"start-step"}')
    assert accumulator.parts == [{"type": "step-start"}]


def test_unknown_chunk_types_are_ignored() -> None:
    accumulator = fold({"type": "abort"}, {"type": "custom-thing", "x": 1}, {"type": None}, {})
    assert accumulator.parts == []
    assert accumulator.metadata is None


def test_role_is_configurable() -> None:
    assert MessageAccumulator("m", role="user").message()["role"] == "user"


# -- text and reasoning ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "reasoning"])
def test_block_lifecycle_streaming_then_done(kind: str) -> None:
    accumulator = fold(
        {"type": f"{kind}-start", "id": "b1"}, {"type": f"{kind}-delta", "id": "b1", "delta": "Hel"}
    )
    assert accumulator.parts == [{"type": kind, "text": "Hel", "state": "streaming"}]
    accumulator.apply({"type": f"{kind}-delta", "id": "b1", "delta": "lo"})
    accumulator.apply({"type": f"{kind}-end", "id": "b1"})
    assert accumulator.parts == [{"type": kind, "text": "Hello", "state": "done"}]


@pytest.mark.parametrize("kind", ["text", "reasoning"])
def test_delta_without_start_opens_the_part(kind: str) -> None:
    accumulator = fold(
        {"type": f"{kind}-delta", "id": "b9", "delta": "orphan "},
        {"type": f"{kind}-delta", "id": "b9", "delta": "text"},
        {"type": f"{kind}-end", "id": "b9"},
    )
    assert accumulator.parts == [{"type": kind, "text": "orphan text", "state": "done"}]


def test_start_keeps_provider_metadata() -> None:
    meta = {"anthropic": {"signature": "abc"}}
    accumulator = fold({"type": "reasoning-start", "id": "r1", "providerMetadata": meta})
    assert accumulator.parts == [
        {"type": "reasoning", "text": "", "state": "streaming", "providerMetadata": meta}
    ]


def test_text_and_reasoning_with_the_same_id_are_separate_parts() -> None:
    accumulator = fold(
        {"type": "reasoning-start", "id": "0"},
        {"type": "text-start", "id": "0"},
        {"type": "reasoning-delta", "id": "0", "delta": "think"},
        {"type": "text-delta", "id": "0", "delta": "say"},
        {"type": "reasoning-end", "id": "0"},
    )
    assert accumulator.parts == [
        {"type": "reasoning", "text": "think", "state": "done"},
        {"type": "text", "text": "say", "state": "streaming"},
    ]
    assert accumulator.text == "say"


def test_interleaved_text_parts_by_id() -> None:
    accumulator = fold(
        {"type": "text-start", "id": "a"},
        {"type": "text-start", "id": "b"},
        {"type": "text-delta", "id": "b", "delta": "B"},
        {"type": "text-delta", "id": "a", "delta": "A"},
        {"type": "text-end", "id": "a"},
    )
    assert accumulator.parts == [
        {"type": "text", "text": "A", "state": "done"},
        {"type": "text", "text": "B", "state": "streaming"},
    ]
    assert accumulator.text == "AB"


def test_end_of_an_unknown_block_is_ignored() -> None:
    accumulator = fold({"type": "text-end", "id": "nope"})
    assert accumulator.parts == []


def test_delta_after_end_opens_a_new_part() -> None:
    accumulator = fold(
        {"type": "text-start", "id": "t"},
        {"type": "text-delta", "id": "t", "delta": "a"},
        {"type": "text-end", "id": "t"},
        {"type": "text-delta", "id": "t", "delta": "b"},
    )
    assert accumulator.parts == [
        {"type": "text", "text": "a", "state": "done"},
        {"type": "text", "text": "b", "state": "streaming"},
    ]


def test_finish_marks_open_blocks_done() -> None:
    accumulator = fold(
        {"type": "text-start", "id": "t"},
        {"type": "text-delta", "id": "t", "delta": "cut"},
        {"type": "finish", "finishReason": "length"},
    )
    assert accumulator.parts == [{"type": "text", "text": "cut", "state": "done"}]
    assert accumulator.finish_reason == "length"


def test_finish_step_closes_blocks_so_the_next_delta_opens_a_new_part() -> None:
    accumulator = fold(
        {"type": "text-start", "id": "t"},
        {"type": "text-delta", "id": "t", "delta": "first"},
        {"type": "finish-step"},
        {"type": "start-step"},
        {"type": "text-delta", "id": "t", "delta": "second"},
        {"type": "text-end", "id": "t"},
    )
    assert [p["type"] for p in accumulator.parts] == ["text", "step-start", "text"]
    assert accumulator.parts[2] == {"type": "text", "text": "second", "state": "done"}
    assert accumulator.text == "firstsecond"


def test_text_property_ignores_other_parts() -> None:
    accumulator = fold(
        {"type": "reasoning-delta", "id": "r", "delta": "hidden"},
        {"type": "text-delta", "id": "t", "delta": "shown"},
        {"type": "data-x", "data": {"text": "nope"}},
    )
    assert accumulator.text == "shown"


# -- start, steps, metadata, finish ------------------------------------------------------------------------
def test_step_start_parts() -> None:
    accumulator = fold({"type": "start-step"}, {"type": "finish-step"}, {"type": "start-step"})
    assert accumulator.parts == [{"type": "step-start"}, {"type": "step-start"}]
    assert not accumulator.has_content


def test_start_with_message_id_sets_the_id() -> None:
    accumulator = fold({"type": "start", "messageId": "asst-42"}, message_id="m-0")
    assert accumulator.message_id == "asst-42"
    assert accumulator.message()["id"] == "asst-42"


@pytest.mark.parametrize(
    "start", [{"type": "start"}, {"type": "start", "messageId": ""}, {"type": "start", "messageId": 3}]
)
def test_start_without_a_usable_message_id_keeps_the_id(start: dict[str, Any]) -> None:
    assert fold(start, message_id="m-0").message()["id"] == "m-0"


def test_metadata_merges_from_start_message_metadata_and_finish() -> None:
    accumulator = fold(
        {"type": "start", "messageId": "a", "messageMetadata": {"model": "x", "createdAt": 1}},
        {"type": "message-metadata", "messageMetadata": {"createdAt": 2, "step": 1}},
        {"type": "finish", "finishReason": "stop", "messageMetadata": {"usage": {"totalTokens": 9}}},
    )
    assert accumulator.metadata == {"model": "x", "createdAt": 2, "step": 1, "usage": {"totalTokens": 9}}
    assert accumulator.message()["metadata"] == accumulator.metadata
    assert accumulator.finish_reason == "stop"


def test_non_object_metadata_is_ignored() -> None:
    accumulator = fold(
        {"type": "start", "messageMetadata": "x"},
        {"type": "message-metadata", "messageMetadata": [1]},
        {"type": "finish", "finishReason": 5},
    )
    assert accumulator.metadata is None
    assert accumulator.finish_reason is None
    assert "metadata" not in accumulator.message()


# -- tools ------------------------------------------------------------------------------------------------
def test_tool_input_lifecycle() -> None:
    accumulator = fold({"type": "tool-input-start", "toolCallId": "c1", "toolName": "getWeather"})
    assert accumulator.parts == [
        {"type": "tool-getWeather", "toolCallId": "c1", "state": "input-streaming", "input": None}
    ]
    accumulator.apply({"type": "tool-input-delta", "toolCallId": "c1", "inputTextDelta": '{"city":'})
    accumulator.apply({"type": "tool-input-delta", "toolCallId": "c1", "inputTextDelta": '"Paris"}'})
    assert accumulator.parts[0]["state"] == "input-streaming"
    accumulator.apply(
        {
            "type": "tool-input-available",
            "toolCallId": "c1",
            "toolName": "getWeather",
            "input": {"city": "Paris"},
        }
    )
    assert accumulator.parts == [
        {
            "type": "tool-getWeather",
            "toolCallId": "c1",
            "state": "input-available",
            "input": {"city": "Paris"},
        }
    ]
    assert accumulator.has_content
    assert not accumulator.has_settled_tool_results


def test_tool_input_available_without_start_creates_the_part() -> None:
    accumulator = fold(
        {
            "type": "tool-input-available",
            "toolCallId": "c1",
            "toolName": "search",
            "input": {"q": "x"},
            "providerExecuted": True,
            "title": "Search",
        }
    )
    assert accumulator.parts == [
        {
            "type": "tool-search",
            "toolCallId": "c1",
            "state": "input-available",
            "input": {"q": "x"},
            "providerExecuted": True,
            "title": "Search",
        }
    ]


def test_tool_input_error() -> None:
    accumulator = fold(
        {"type": "tool-input-start", "toolCallId": "c1", "toolName": "calc"},
        {
            "type": "tool-input-error",
            "toolCallId": "c1",
            "toolName": "calc",
            "input": "{bad",
            "errorText": "bad",
        },
    )
    assert accumulator.parts == [
        {
            "type": "tool-calc",
            "toolCallId": "c1",
            "state": "output-error",
            "input": "{bad",
            "errorText": "bad",
        }
    ]
    assert accumulator.has_settled_tool_results


def test_approval_request_matches_the_reference_fold() -> None:
    """Reasoning -> text -> tool input -> tool-approval-request, as readUIMessageStream folds it."""
    accumulator = fold(
        {"type": "start", "messageId": "a-1"},
        {"type": "start-step"},
        {"type": "reasoning-start", "id": "r1"},
        {"type": "reasoning-delta", "id": "r1", "delta": "I should check."},
        {"type": "reasoning-end", "id": "r1"},
        {"type": "text-start", "id": "t1"},
        {"type": "text-delta", "id": "t1", "delta": "Checking the weather."},
        {"type": "text-end", "id": "t1"},
        {"type": "tool-input-start", "toolCallId": "T", "toolName": "getWeather"},
        {"type": "tool-input-delta", "toolCallId": "T", "inputTextDelta": '{"city":'},
        {"type": "tool-input-delta", "toolCallId": "T", "inputTextDelta": '"Paris"}'},
        {
            "type": "tool-input-available",
            "toolCallId": "T",
            "toolName": "getWeather",
            "input": {"city": "Paris"},
        },
        {"type": "tool-approval-request", "approvalId": "ap_1", "toolCallId": "T"},
        {"type": "finish-step"},
        {"type": "finish", "finishReason": "tool-calls"},
    )
    assert accumulator.message() == {
        "id": "a-1",
        "role": "assistant",
        "parts": [
            {"type": "step-start"},
            {"type": "reasoning", "text": "I should check.", "state": "done"},
            {"type": "text", "text": "Checking the weather.", "state": "done"},
            {
                "type": "tool-getWeather",
                "toolCallId": "T",
                "state": "approval-requested",
                "input": {"city": "Paris"},
                "approval": {"id": "ap_1"},
            },
        ],
    }
    assert not accumulator.has_settled_tool_results


def test_approval_request_for_an_unknown_call_is_ignored() -> None:
    accumulator = fold({"type": "tool-approval-request", "approvalId": "ap", "toolCallId": "nope"})
    assert accumulator.parts == []
    assert accumulator.foreign_tool_updates == []


TOOL_CALL = [
    {"type": "tool-input-start", "toolCallId": "c1", "toolName": "lookup"},
    {"type": "tool-input-available", "toolCallId": "c1", "toolName": "lookup", "input": {"id": 1}},
]


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        (
            {"type": "tool-output-available", "toolCallId": "c1", "output": {"name": "x"}},
            {"state": "output-available", "output": {"name": "x"}},
        ),
        (
            {"type": "tool-output-available", "toolCallId": "c1", "output": None},
            {"state": "output-available", "output": None},
        ),
        (
            {"type": "tool-output-error", "toolCallId": "c1", "errorText": "timeout"},
            {"state": "output-error", "errorText": "timeout"},
        ),
        ({"type": "tool-output-error", "toolCallId": "c1"}, {"state": "output-error", "errorText": ""}),
        ({"type": "tool-output-denied", "toolCallId": "c1"}, {"state": "output-denied"}),
    ],
)
def test_tool_outputs_settle_the_part(chunk: dict[str, Any], expected: dict[str, Any]) -> None:
    accumulator = fold(*TOOL_CALL, chunk)
    assert accumulator.parts == [{"type": "tool-lookup", "toolCallId": "c1", "input": {"id": 1}, **expected}]
    assert accumulator.has_settled_tool_results
    assert accumulator.foreign_tool_updates == []


def test_preliminary_output_is_flagged() -> None:
    accumulator = fold(
        *TOOL_CALL, {"type": "tool-output-available", "toolCallId": "c1", "output": "..", "preliminary": True}
    )
    assert accumulator.parts[0]["preliminary"] is True
    assert accumulator.parts[0]["output"] == ".."


def test_final_output_clears_the_preliminary_flag() -> None:
    accumulator = fold(
        *TOOL_CALL,
        {"type": "tool-output-available", "toolCallId": "c1", "output": "partial", "preliminary": True},
        {"type": "tool-output-available", "toolCallId": "c1", "output": "final"},
    )
    assert accumulator.parts[0]["output"] == "final"
    assert not accumulator.parts[0].get("preliminary")


def test_dynamic_tool() -> None:
    accumulator = fold(
        {"type": "tool-input-start", "toolCallId": "d1", "toolName": "mcp_search", "dynamic": True},
        {
            "type": "tool-input-available",
            "toolCallId": "d1",
            "toolName": "mcp_search",
            "input": {},
            "dynamic": True,
        },
        {"type": "tool-output-available", "toolCallId": "d1", "output": [1], "dynamic": True},
    )
    assert accumulator.parts == [
        {
            "type": "dynamic-tool",
            "toolName": "mcp_search",
            "toolCallId": "d1",
            "state": "output-available",
            "input": {},
            "output": [1],
        }
    ]
    assert is_tool_part(accumulator.parts[0])
    assert tool_name_of(accumulator.parts[0]) == "mcp_search"


def test_parallel_tool_calls_settle_independently() -> None:
    accumulator = fold(
        {"type": "tool-input-available", "toolCallId": "a", "toolName": "one", "input": {}},
        {"type": "tool-input-available", "toolCallId": "b", "toolName": "two", "input": {}},
        {"type": "tool-output-available", "toolCallId": "b", "output": "B"},
    )
    assert [(p["toolCallId"], p["state"]) for p in accumulator.parts] == [
        ("a", "input-available"),
        ("b", "output-available"),
    ]


@pytest.mark.parametrize(
    ("chunk", "update"),
    [
        (
            {"type": "tool-output-available", "toolCallId": "T", "output": {"temp": 21}},
            {"toolCallId": "T", "state": "output-available", "output": {"temp": 21}},
        ),
        (
            {"type": "tool-output-available", "toolCallId": "T", "output": 1, "preliminary": True},
            {"toolCallId": "T", "state": "output-available", "output": 1, "preliminary": True},
        ),
        (
            {"type": "tool-output-error", "toolCallId": "T", "errorText": "no"},
            {"toolCallId": "T", "state": "output-error", "errorText": "no"},
        ),
        ({"type": "tool-output-denied", "toolCallId": "T"}, {"toolCallId": "T", "state": "output-denied"}),
    ],
)
def test_cross_message_tool_outputs_are_foreign_updates(
    chunk: dict[str, Any], update: dict[str, Any]
) -> None:
    accumulator = fold({"type": "start", "messageId": "cont-1"}, {"type": "start-step"}, chunk)
    assert accumulator.foreign_tool_updates == [update]
    assert accumulator.parts == [{"type": "step-start"}]
    assert not accumulator.has_settled_tool_results
    assert not accumulator.has_content


# -- data, sources, files, errors -------------------------------------------------------------------------
def test_transient_data_parts_are_skipped() -> None:
    accumulator = fold({"type": "data-progress", "data": {"pct": 50}, "transient": True})
    assert accumulator.parts == []
    assert not accumulator.has_content


def test_data_parts_with_the_same_id_update_in_place() -> None:
    accumulator = fold(
        {"type": "data-weather", "id": "w1", "data": {"status": "loading"}},
        {"type": "text-delta", "id": "t", "delta": "x"},
        {"type": "data-weather", "id": "w1", "data": {"status": "done", "temp": 20}},
        {"type": "data-other", "id": "w1", "data": 1},
        {"type": "data-weather", "id": "w2", "data": 2},
    )
    assert accumulator.parts == [
        {"type": "data-weather", "id": "w1", "data": {"status": "done", "temp": 20}},
        {"type": "text", "text": "x", "state": "streaming"},
        {"type": "data-other", "id": "w1", "data": 1},
        {"type": "data-weather", "id": "w2", "data": 2},
    ]


def test_data_parts_without_id_are_appended() -> None:
    accumulator = fold(
        {"type": "data-log", "data": "a"}, {"type": "data-log", "data": "b", "transient": False}
    )
    assert accumulator.parts == [{"type": "data-log", "data": "a"}, {"type": "data-log", "data": "b"}]
    assert accumulator.has_content


def test_sources_and_files_are_appended_as_parts() -> None:
    chunks = [
        {"type": "source-url", "sourceId": "s1", "url": "https://example.com", "title": "Ex"},
        {"type": "source-document", "sourceId": "s2", "mediaType": "application/pdf", "title": "Doc"},
        {"type": "file", "url": "data:image/png;base64,AA==", "mediaType": "image/png"},
    ]
    accumulator = fold(*chunks)
    assert accumulator.parts == chunks
    assert accumulator.parts[0] is not chunks[0]  # copied, not aliased
    assert accumulator.has_content


def test_error_chunk_is_recorded_not_appended() -> None:
    accumulator = fold(
        {"type": "text-delta", "id": "t", "delta": "partial"}, {"type": "error", "errorText": "boom"}
    )
    assert accumulator.error_text == "boom"
    assert accumulator.parts == [{"type": "text", "text": "partial", "state": "streaming"}]


def test_error_chunk_without_text() -> None:
    assert fold({"type": "error"}).error_text == ""


# -- is_settled_tool_part ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("part", "settled"),
    [
        ({"type": "tool-x", "state": "output-available", "output": 1}, True),
        ({"type": "tool-x", "state": "output-error", "errorText": "e"}, True),
        ({"type": "tool-x", "state": "output-denied"}, True),
        ({"type": "dynamic-tool", "toolName": "x", "state": "output-available"}, True),
        ({"type": "tool-x", "state": "input-available", "output": None}, True),
        ({"type": "tool-invocation", "result": 1}, True),
        ({"type": "tool-x", "state": "input-streaming"}, False),
        ({"type": "tool-x", "state": "input-available"}, False),
        ({"type": "tool-x", "state": "approval-requested", "approval": {"id": "a"}}, False),
        ({"type": "tool-x", "state": "approval-responded", "approval": {"id": "a", "approved": True}}, False),
        ({"type": "text", "text": "x", "output": 1}, False),
        ({"type": "data-tool", "state": "output-available"}, False),
        ({"state": "output-available"}, False),
    ],
)
def test_is_settled_tool_part(part: dict[str, Any], settled: bool) -> None:
    assert is_settled_tool_part(part) is settled


@pytest.mark.parametrize(
    ("part", "name"),
    [
        ({"type": "tool-getWeather"}, "getWeather"),
        ({"type": "tool-"}, ""),
        ({"type": "dynamic-tool", "toolName": "mcp"}, "mcp"),
        ({"type": "dynamic-tool"}, ""),
    ],
)
def test_tool_name_of(part: dict[str, Any], name: str) -> None:
    assert tool_name_of(part) == name


# -- message_chunks: a stored message replayed as chunks ------------------------------------------------
REPLAYED = [
    [
        {"type": "start-step"},
        {"type": "text-start", "id": "a"},
        {"type": "text-delta", "id": "a", "delta": "hi"},
    ],
    [
        {"type": "start-step"},
        {"type": "reasoning-start", "id": "r", "providerMetadata": {"x": {"y": 1}}},
        {"type": "reasoning-delta", "id": "r", "delta": "think"},
        {"type": "reasoning-end", "id": "r"},
        {"type": "text-start", "id": "t"},
        {"type": "text-delta", "id": "t", "delta": "1 2"},
        {"type": "text-end", "id": "t"},
        {"type": "tool-input-start", "toolCallId": "c1", "toolName": "w"},
        {"type": "tool-input-available", "toolCallId": "c1", "toolName": "w", "input": {"city": "Oslo"}},
        {"type": "tool-output-available", "toolCallId": "c1", "output": {"sky": "clear"}},
        {"type": "finish-step"},
        {"type": "start-step"},
        {"type": "tool-input-available", "toolCallId": "c2", "toolName": "e", "input": {}, "dynamic": True},
        {"type": "tool-output-error", "toolCallId": "c2", "errorText": "no"},
        {
            "type": "tool-input-error",
            "toolCallId": "c3",
            "toolName": "x",
            "input": "{bad",
            "errorText": "bad",
        },
        {"type": "tool-input-available", "toolCallId": "c4", "toolName": "d", "input": {"f": 1}},
        {"type": "tool-output-denied", "toolCallId": "c4"},
        {"type": "tool-input-available", "toolCallId": "c5", "toolName": "s", "input": {}},
        {"type": "tool-approval-request", "approvalId": "A", "toolCallId": "c5"},
        {"type": "tool-input-start", "toolCallId": "c6", "toolName": "cut"},
        {"type": "data-progress", "id": "p", "data": {"pct": 50}},
        {"type": "source-url", "sourceId": "s1", "url": "https://example.com"},
        {"type": "file", "url": "data:,x", "mediaType": "text/plain"},
        {"type": "tool-input-available", "toolCallId": "c7", "toolName": "w", "input": {}},
        {"type": "tool-output-available", "toolCallId": "c7", "output": 1, "preliminary": True},
        {"type": "finish", "messageMetadata": {"usage": {"totalTokens": 3}}},
    ],
]


@pytest.mark.parametrize("chunks", REPLAYED)
def test_a_message_replayed_as_chunks_folds_back_to_itself(chunks: list[dict[str, Any]]) -> None:
    message = fold({"type": "start", "messageId": "m-1"}, *chunks).message()
    replay = message_chunks(message)
    assert replay[0]["type"] == "start" and replay[0]["messageId"] == "m-1"
    assert fold(*replay).message() == message


def test_an_answered_approval_replays_as_its_request() -> None:
    """No chunk says "approval-responded": a replay shows the request until the tool's output comes."""
    part = {
        "type": "tool-send",
        "toolCallId": "c",
        "state": "approval-responded",
        "input": {},
        "approval": {"id": "A", "approved": True},
    }
    [replayed] = fold(*message_chunks({"id": "m", "role": "assistant", "parts": [part]})).parts
    assert replayed == {**part, "state": "approval-requested", "approval": {"id": "A"}}
