"""Transcript repair and pending interactions, as pure functions.

Names follow the reference's message-reconciliation and client-tools suites.
"""

from __future__ import annotations

from typing import Any

import pytest

from chat.transcript.repair import (
    INTERRUPTED_TOOL_ERROR,
    batch_complete,
    default_repair,
    normalize_input,
    pending_interaction,
    repair_transcript,
)


def assistant(*parts: dict[str, Any], message_id: str = "a1") -> dict[str, Any]:
    return {"id": message_id, "role": "assistant", "parts": list(parts)}


def tool_part(state: str | None, *, name: str = "search", call: str = "c1", **extra: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"type": f"tool-{name}", "toolCallId": call, "input": {"q": "x"}}
    if state is not None:
        part["state"] = state
    part.update(extra)
    return part


USER = {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}


# -- message-reconciliation -----------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["input-streaming", "input-available", "approval-requested", None])
def test_an_orphan_is_repaired_before_the_next_turn(state: str | None) -> None:
    messages = [USER, assistant({"type": "step-start"}, tool_part(state))]
    report = repair_transcript(messages, default_repair)
    repaired = report.messages[1]["parts"][1]
    assert repaired["state"] == "output-error"
    assert repaired["errorText"] == INTERRUPTED_TOOL_ERROR
    assert repaired["type"] == "tool-search" and repaired["toolCallId"] == "c1"
    assert report.event() == {"removedToolCalls": 1, "normalizedInputs": 0, "toolCallIds": ["c1"]}
    assert report.changed == [report.messages[1]]
    assert report.messages[0] is USER, "unchanged messages keep their identity"
    assert messages[1]["parts"][1].get("state") == state, "the input transcript is not mutated"


def test_normalized_inputs_are_reported_for_settled_parts() -> None:
    part = tool_part("output-available", output=1, input='{"q": "y"}')
    report = repair_transcript([assistant(part)], default_repair)
    assert report.messages[0]["parts"][0]["input"] == {"q": "y"}
    assert report.normalized_inputs == 1 and report.removed_tool_calls == 0 and report.any


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ({"a": 1}, {"a": 1}),
        ('{"a": 1}', {"a": 1}),
        ('  {"a": 1}', {"a": 1}),
        ('{"a": ', {}),
        ("[1, 2]", {}),
        ([1, 2], {}),
        ("text", {}),
        (None, {}),
        (3, {}),
    ],
)
def test_arrays_partial_json_and_missing_input_become_objects(value: Any, expected: dict[str, Any]) -> None:
    assert normalize_input(value) == expected


def test_missing_input_on_an_orphan_becomes_an_empty_object() -> None:
    part = {"type": "dynamic-tool", "toolName": "x", "toolCallId": "c9", "state": "input-streaming"}
    [message] = repair_transcript([assistant(part)], default_repair).messages
    assert message["parts"][0]["input"] == {} and message["parts"][0]["toolName"] == "x"


def test_an_already_errored_call_is_not_repaired_again_and_keeps_its_error_text() -> None:
    part = tool_part("output-error", errorText="boom")
    report = repair_transcript([assistant(part)], default_repair)
    assert not report.any and report.messages[0]["parts"][0] is part


def test_output_denied_is_kept() -> None:
    part = tool_part("output-denied", approval={"id": "ap", "approved": False})
    assert not repair_transcript([assistant(part)], default_repair).any


def test_an_approved_pending_tool_is_not_repaired() -> None:  # #1627
    part = tool_part("approval-responded", approval={"id": "ap", "approved": True})
    assert not repair_transcript([assistant(part)], default_repair).any


def test_a_transcript_that_needs_nothing_causes_no_change() -> None:
    messages = [USER, assistant({"type": "text", "text": "hello"}, tool_part("output-available", output=2))]
    report = repair_transcript(messages, default_repair)
    assert not report.any and report.messages == messages


def test_parts_without_a_call_id_are_not_tool_calls() -> None:
    part = {"type": "tool-search", "state": "input-available"}
    assert not repair_transcript([assistant(part)], default_repair).any


# -- client-tools: the override ----------------------------------------------------------------------------
def ask_user_as_text(part: dict[str, Any]) -> dict[str, Any]:
    if part["type"] == "tool-ask_user":
        return {"type": "text", "text": "(question interrupted)"}
    return default_repair(part)


def test_the_override_turns_ask_user_into_text_and_leaves_other_tools_to_the_default() -> None:
    settled = tool_part("output-available", call="c3", output="ok")
    message = assistant(
        tool_part("input-available", name="ask_user", call="c1"),
        tool_part("input-streaming", call="c2"),
        settled,
    )
    [repaired] = repair_transcript([message], ask_user_as_text).messages
    assert repaired["parts"][0] == {"type": "text", "text": "(question interrupted)"}
    assert repaired["parts"][1]["state"] == "output-error"
    assert repaired["parts"][2] is settled


def test_an_override_that_returns_an_unsettled_tool_part_is_refused() -> None:
    with pytest.raises(ValueError, match="unsettled tool part"):
        repair_transcript([assistant(tool_part("input-available"))], lambda part: part)


# -- waitUntilStable's pending rule ----------------------------------------------------------------------
def test_nothing_pending() -> None:
    assert not pending_interaction([USER, assistant(tool_part("output-available", output=1))], {"search"})


def test_a_pending_client_tool_is_detected() -> None:
    messages = [USER, assistant(tool_part("input-available", name="get_location"))]
    assert pending_interaction(messages, {"get_location"})


def test_a_server_tool_orphan_is_not_pending() -> None:
    assert not pending_interaction([assistant(tool_part("input-available"))], {"get_location"})


def test_a_pending_approval_is_detected_whatever_the_tool() -> None:
    assert pending_interaction([assistant(tool_part("approval-requested", approval={"id": "a"}))], set())


def test_client_tools_run_inline_are_not_pending() -> None:
    # A chat() caller's inline tools are not in the conversation's client tools: nothing to wait for.
    assert not pending_interaction([assistant(tool_part("input-available", name="inline"))], set())


def test_user_messages_are_never_pending() -> None:
    user = {"id": "u", "role": "user", "parts": [tool_part("approval-requested")]}
    assert not pending_interaction([user], set())


def test_a_batch_is_complete_once_every_call_is_answered_or_approved() -> None:
    waiting = assistant(tool_part("output-available", output=1), tool_part("input-available", call="c2"))
    assert not batch_complete(waiting)
    approved = tool_part("approval-responded", call="c2", approval={"id": "a", "approved": True})
    assert batch_complete(assistant(tool_part("output-available", output=1), approved))
