"""The cf_agent_* wire codec: client frame parsing and server frame building (no database)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from chat import protocol as p
from chat.protocol import (
    Cancel,
    ChatRequest,
    Clear,
    ClientMessages,
    ProtocolError,
    ResumeAck,
    ResumeRequest,
    ToolApproval,
    ToolResult,
    parse_frame,
)
from recovery.stream.encoding import dumps

USER_MESSAGE = {"id": "u-1", "role": "user", "parts": [{"type": "text", "text": "hello"}]}


def chat_request(body: Any, *, request_id: Any = "req-1", method: Any = "POST", **extra: Any) -> str:
    """A use_chat_request frame; a dict body is JSON-encoded like the client's init.body."""
    init: dict[str, Any] = {"method": method, "body": json.dumps(body) if isinstance(body, dict) else body}
    return json.dumps({"type": p.USE_CHAT_REQUEST, "id": request_id, "init": init, **extra})


def frame(**fields: Any) -> str:
    return json.dumps(fields)


# -- client frames: the happy paths --------------------------------------------------------------------
def test_parses_the_chat_request_captured_from_the_real_client() -> None:
    text = (
        '{"id":"_7m9oTQg","init":{"method":"POST","body":"{\\"messages\\":[{\\"id\\":\\"u-1\\",'
        '\\"role\\":\\"user\\",\\"parts\\":[{\\"type\\":\\"text\\",\\"text\\":\\"hello\\"}]}],'
        '\\"trigger\\":\\"submit-message\\"}"},"type":"cf_agent_use_chat_request"}'
    )
    parsed = parse_frame(text)
    assert parsed == ChatRequest(
        id="_7m9oTQg",
        messages=[{**USER_MESSAGE, "metadata": None}],
        trigger="submit-message",
        extra={},
        client_tools=None,
    )


def test_chat_request_keeps_client_tools_and_custom_fields_in_extra() -> None:
    tools = [
        {"name": "getLocation", "description": "Where the user is", "parameters": {"type": "object"}},
        {"name": "confirm"},
    ]
    body = {
        "messages": [USER_MESSAGE],
        "trigger": "submit-message",
        "clientTools": tools,
        "temperature": 0.2,
        "userId": "alice",
        "nested": {"a": [1, 2]},
    }
    parsed = parse_frame(chat_request(body))
    assert isinstance(parsed, ChatRequest)
    assert parsed.id == "req-1"
    assert parsed.client_tools == tools
    assert parsed.extra == {"temperature": 0.2, "userId": "alice", "nested": {"a": [1, 2]}}
    assert "clientTools" not in parsed.extra and "messages" not in parsed.extra


def test_chat_request_message_is_normalised_with_metadata() -> None:
    message = {"id": "a-1", "role": "assistant", "parts": [], "metadata": {"model": "x"}, "junk": 1}
    parsed = parse_frame(chat_request({"messages": [USER_MESSAGE, message]}))
    assert isinstance(parsed, ChatRequest)
    assert parsed.messages == [
        {**USER_MESSAGE, "metadata": None},
        {"id": "a-1", "role": "assistant", "parts": [], "metadata": {"model": "x"}},
    ]


def test_chat_request_defaults() -> None:
    parsed = parse_frame(chat_request({"messages": []}))
    assert parsed == ChatRequest(id="req-1", messages=[], trigger="submit-message", extra={})
    assert parsed.client_tools is None


def test_chat_request_message_without_parts_gets_an_empty_list() -> None:
    parsed = parse_frame(chat_request({"messages": [{"id": "s", "role": "system"}]}))
    assert isinstance(parsed, ChatRequest)
    assert parsed.messages == [{"id": "s", "role": "system", "parts": [], "metadata": None}]


def test_chat_request_without_method_is_accepted_as_post() -> None:
    text = json.dumps({"type": p.USE_CHAT_REQUEST, "id": "r", "init": {"body": json.dumps({"messages": []})}})
    assert isinstance(parse_frame(text), ChatRequest)


def test_chat_request_regenerate_trigger() -> None:
    parsed = parse_frame(chat_request({"messages": [USER_MESSAGE], "trigger": "regenerate-message"}))
    assert isinstance(parsed, ChatRequest)
    assert parsed.trigger == "regenerate-message"


def test_chat_request_accepts_bytes() -> None:
    parsed = parse_frame(chat_request({"messages": [USER_MESSAGE]}).encode())
    assert isinstance(parsed, ChatRequest)
    assert parsed.messages[0]["id"] == "u-1"


def test_chat_request_unicode_body() -> None:
    message = {"id": "u-ü", "role": "user", "parts": [{"type": "text", "text": '日本語 🙂 "q"\n'}]}
    parsed = parse_frame(chat_request({"messages": [message]}))
    assert isinstance(parsed, ChatRequest)
    assert parsed.messages[0]["parts"][0]["text"] == '日本語 🙂 "q"\n'


def test_cancel() -> None:
    assert parse_frame('{"id":"R","type":"cf_agent_chat_request_cancel"}') == Cancel("R")


def test_clear() -> None:
    assert parse_frame('{"type":"cf_agent_chat_clear"}') == Clear()


@pytest.mark.parametrize(
    ("fields", "probe_id"),
    [({"probeId": "dGlqGV_4"}, "dGlqGV_4"), ({}, None), ({"probeId": None}, None)],
)
def test_resume_request(fields: dict[str, Any], probe_id: str | None) -> None:
    assert parse_frame(frame(type=p.STREAM_RESUME_REQUEST, **fields)) == ResumeRequest(probe_id)


def test_resume_ack() -> None:
    assert parse_frame(frame(type=p.STREAM_RESUME_ACK, id="_7m9oTQg")) == ResumeAck("_7m9oTQg")


def test_tool_result_with_all_fields() -> None:
    tools = [{"name": "getLocation"}]
    parsed = parse_frame(
        frame(
            type=p.TOOL_RESULT,
            toolCallId="call_1",
            toolName="getLocation",
            output={"lat": 1.5, "lng": 2},
            state="output-available",
            autoContinue=True,
            clientTools=tools,
        )
    )
    assert parsed == ToolResult(
        tool_call_id="call_1",
        tool_name="getLocation",
        output={"lat": 1.5, "lng": 2},
        state="output-available",
        error_text=None,
        auto_continue=True,
        client_tools=tools,
    )


def test_tool_result_defaults() -> None:
    parsed = parse_frame(frame(type=p.TOOL_RESULT, toolCallId="call_1", output="ok"))
    assert parsed == ToolResult(
        tool_call_id="call_1",
        tool_name="",
        output="ok",
        state="output-available",
        error_text=None,
        auto_continue=True,
        client_tools=None,
    )


def test_tool_result_empty_tool_name_is_allowed() -> None:
    parsed = parse_frame(frame(type=p.TOOL_RESULT, toolCallId="c", toolName="", output=None))
    assert isinstance(parsed, ToolResult)
    assert parsed.tool_name == ""
    assert parsed.output is None


def test_tool_result_auto_continue_false_is_kept() -> None:
    parsed = parse_frame(frame(type=p.TOOL_RESULT, toolCallId="c", output=1, autoContinue=False))
    assert isinstance(parsed, ToolResult)
    assert parsed.auto_continue is False


@pytest.mark.parametrize(("auto_continue", "expected"), [(True, True), (False, False), (None, False)])
def test_tool_result_output_error_defaults_auto_continue_false(
    auto_continue: bool | None, expected: bool
) -> None:
    fields: dict[str, Any] = {"type": p.TOOL_RESULT, "toolCallId": "c", "state": "output-error"}
    fields["errorText"] = "it broke"
    if auto_continue is not None:
        fields["autoContinue"] = auto_continue
    parsed = parse_frame(json.dumps(fields))
    assert isinstance(parsed, ToolResult)
    assert parsed.state == "output-error"
    assert parsed.error_text == "it broke"
    assert parsed.auto_continue is expected


@pytest.mark.parametrize(
    ("fields", "approved", "auto_continue"),
    [
        ({"approved": True}, True, True),
        ({"approved": False}, False, True),
        ({"approved": True, "autoContinue": False}, True, False),
        ({"approved": False, "autoContinue": True}, False, True),
    ],
)
def test_tool_approval(fields: dict[str, Any], approved: bool, auto_continue: bool) -> None:
    parsed = parse_frame(frame(type=p.TOOL_APPROVAL, toolCallId="T", **fields))
    assert parsed == ToolApproval("T", approved, auto_continue)


def test_client_chat_messages() -> None:
    assistant = {"id": "a-1", "role": "assistant", "parts": [{"type": "step-start"}]}
    parsed = parse_frame(frame(type=p.CHAT_MESSAGES, messages=[USER_MESSAGE, assistant]))
    assert parsed == ClientMessages([{**USER_MESSAGE, "metadata": None}, {**assistant, "metadata": None}])


def test_client_chat_messages_empty() -> None:
    assert parse_frame(frame(type=p.CHAT_MESSAGES, messages=[])) == ClientMessages([])


# -- client frames: malformed ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "{", "not json", "{'type': 'x'}", b"\xff\xfe\x00"])
def test_not_json_is_a_protocol_error(text: str | bytes) -> None:
    with pytest.raises(ProtocolError, match="frame is not JSON"):
        parse_frame(text)


@pytest.mark.parametrize("text", ["[]", "1", '"cf_agent_chat_clear"', "null", "true", '[{"type":"x"}]'])
def test_not_an_object_is_a_protocol_error(text: str) -> None:
    with pytest.raises(ProtocolError, match="not a JSON object"):
        parse_frame(text)


def test_protocol_error_is_a_value_error() -> None:
    assert issubclass(ProtocolError, ValueError)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (chat_request({"messages": []}, request_id=None), "'id' must be a non-empty string"),
        (chat_request({"messages": []}, request_id=""), "'id' must be a non-empty string"),
        (chat_request({"messages": []}, request_id=7), "'id' must be a non-empty string"),
        (chat_request({"messages": []}, request_id="x" * 256), "'id' is longer than 255"),
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": "r"}), "'init' must be an object with method POST"),
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": "r", "init": "x"}), "'init' must be an object"),
        (chat_request({"messages": []}, method="GET"), "'init' must be an object with method POST"),
        (chat_request({"messages": []}, method=None), "'init' must be an object with method POST"),
        (
            json.dumps({"type": p.USE_CHAT_REQUEST, "id": "r", "init": {"body": {"messages": []}}}),
            "'init.body' must be a JSON string",
        ),
        (
            json.dumps({"type": p.USE_CHAT_REQUEST, "id": "r", "init": {"method": "POST"}}),
            "'init.body' must be a JSON string",
        ),
        (chat_request("{not json"), "'init.body' is not valid JSON"),
        (chat_request(""), "'init.body' is not valid JSON"),
        (chat_request("[]"), "'init.body' must be an object with a 'messages' array"),
        (chat_request({"trigger": "submit-message"}), "'messages' array"),
        (chat_request({"messages": {"id": "u"}}), "'messages' array"),
        (chat_request({"messages": "hello"}), "'messages' array"),
        (chat_request({"messages": None}), "'messages' array"),
    ],
)
def test_malformed_chat_request(text: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_frame(text)


def test_request_id_of_exactly_max_length_is_accepted() -> None:
    parsed = parse_frame(chat_request({"messages": []}, request_id="x" * p.MAX_ID_LENGTH))
    assert isinstance(parsed, ChatRequest)
    assert len(parsed.id) == 255


@pytest.mark.parametrize(
    ("message", "match"),
    [
        ("hello", "each message must be an object"),
        (None, "each message must be an object"),
        ({"role": "user", "parts": []}, "needs a string 'id'"),
        ({"id": "", "role": "user"}, "needs a string 'id'"),
        ({"id": 12, "role": "user"}, "needs a string 'id'"),
        ({"id": "m" * 256, "role": "user"}, "at most 255 characters"),
        ({"id": "m", "role": "tool"}, "'role' must be one of user, assistant, system"),
        ({"id": "m"}, "'role' must be one of"),
        ({"id": "m", "role": "User"}, "'role' must be one of"),
        ({"id": "m", "role": "user", "parts": "text"}, "'parts' must be a list of objects with a 'type'"),
        ({"id": "m", "role": "user", "parts": None}, "'parts' must be a list"),
        ({"id": "m", "role": "user", "parts": ["text"]}, "'parts' must be a list"),
        ({"id": "m", "role": "user", "parts": [{"text": "hi"}]}, "'parts' must be a list"),
        ({"id": "m", "role": "user", "parts": [{"type": 3}]}, "'parts' must be a list"),
        ({"id": "m", "role": "user", "parts": [], "metadata": [1]}, "'metadata' must be an object"),
        ({"id": "m", "role": "user", "parts": [], "metadata": "x"}, "'metadata' must be an object"),
    ],
)
def test_bad_message_in_chat_request(message: Any, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_frame(chat_request({"messages": [USER_MESSAGE, message]}))


def test_bad_message_error_names_the_message() -> None:
    with pytest.raises(ProtocolError, match="message 'm-7'"):
        parse_frame(chat_request({"messages": [{"id": "m-7", "role": "robot"}]}))


def test_message_id_of_exactly_max_length_is_accepted() -> None:
    message = {"id": "m" * 255, "role": "user", "parts": []}
    parsed = parse_frame(chat_request({"messages": [message]}))
    assert isinstance(parsed, ChatRequest)
    assert parsed.messages[0]["id"] == "m" * 255


@pytest.mark.parametrize("trigger", ["submit", "regenerate", "", None, 1, "SUBMIT-MESSAGE"])
def test_bad_trigger(trigger: Any) -> None:
    with pytest.raises(ProtocolError, match="'trigger' must be submit-message or regenerate-message"):
        parse_frame(chat_request({"messages": [], "trigger": trigger}))


@pytest.mark.parametrize(
    "client_tools",
    [{"name": "x"}, "x", [{"description": "no name"}], [{"name": 3}], ["getLocation"], [None]],
)
def test_bad_client_tools(client_tools: Any) -> None:
    with pytest.raises(ProtocolError, match="'clientTools' must be a list of objects with a 'name'"):
        parse_frame(chat_request({"messages": [], "clientTools": client_tools}))


def test_bad_client_tools_on_a_tool_result() -> None:
    with pytest.raises(ProtocolError, match="'clientTools'"):
        parse_frame(frame(type=p.TOOL_RESULT, toolCallId="c", clientTools=[{}]))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({}, "'toolCallId' must be a non-empty string"),
        ({"toolCallId": ""}, "'toolCallId' must be a non-empty string"),
        ({"toolCallId": 5}, "'toolCallId' must be a non-empty string"),
        ({"toolCallId": "c" * 256}, "'toolCallId' is longer than 255"),
        ({"toolCallId": "c", "toolName": 5}, "'toolName' must be a non-empty string"),
        ({"toolCallId": "c", "toolName": "n" * 256}, "'toolName' is longer than 255"),
        ({"toolCallId": "c", "state": "output-denied"}, "'state' must be output-available or output-error"),
        ({"toolCallId": "c", "state": "input-available"}, "'state' must be"),
        ({"toolCallId": "c", "errorText": 42}, "'errorText' must be a string"),
    ],
)
def test_malformed_tool_result(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_frame(frame(type=p.TOOL_RESULT, **fields))


@pytest.mark.parametrize("approved", ["true", 1, 0, None, "yes"])
def test_tool_approval_needs_a_boolean(approved: Any) -> None:
    with pytest.raises(ProtocolError, match="'approved' must be a boolean"):
        parse_frame(frame(type=p.TOOL_APPROVAL, toolCallId="T", approved=approved))


def test_tool_approval_missing_approved() -> None:
    with pytest.raises(ProtocolError, match="'approved' must be a boolean"):
        parse_frame(frame(type=p.TOOL_APPROVAL, toolCallId="T"))


def test_tool_approval_missing_tool_call_id() -> None:
    with pytest.raises(ProtocolError, match="'toolCallId' must be a non-empty string"):
        parse_frame(frame(type=p.TOOL_APPROVAL, approved=True))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({}, "'id' must be a non-empty string"),
        ({"id": ""}, "'id' must be a non-empty string"),
        ({"id": ["R"]}, "'id' must be a non-empty string"),
        ({"id": "R" * 256}, "'id' is longer than 255 characters"),
    ],
)
@pytest.mark.parametrize("frame_type", [p.CHAT_REQUEST_CANCEL, p.STREAM_RESUME_ACK])
def test_bad_id_on_cancel_and_ack(frame_type: str, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_frame(frame(type=frame_type, **fields))


@pytest.mark.parametrize("probe_id", [5, ["p"], {"p": 1}, "p" * 256])
def test_bad_probe_id(probe_id: Any) -> None:
    with pytest.raises(ProtocolError, match="'probeId' must be a short string"):
        parse_frame(frame(type=p.STREAM_RESUME_REQUEST, probeId=probe_id))


@pytest.mark.parametrize("messages", [None, "x", {"id": "u"}])
def test_client_messages_must_be_a_list(messages: Any) -> None:
    with pytest.raises(ProtocolError, match="'messages' must be an array"):
        parse_frame(frame(type=p.CHAT_MESSAGES, messages=messages))


def test_client_messages_validates_each_message() -> None:
    with pytest.raises(ProtocolError, match="'role' must be one of"):
        parse_frame(frame(type=p.CHAT_MESSAGES, messages=[{"id": "m", "role": "bot", "parts": []}]))


# -- limits and what Postgres cannot store ---------------------------------------------------------------
SMALL = p.Limits(max_frame_bytes=200, max_message_bytes=120, max_message_parts=2, max_tool_output_bytes=50)


def test_frame_size_is_counted_in_utf8_bytes() -> None:
    fits = json.dumps({"type": p.STREAM_RESUME_REQUEST, "probeId": "é" * 60}, ensure_ascii=False)
    assert len(fits.encode()) <= SMALL.max_frame_bytes
    assert isinstance(parse_frame(fits, SMALL), ResumeRequest)
    over = json.dumps({"type": p.STREAM_RESUME_REQUEST, "probeId": "日" * 60}, ensure_ascii=False)
    assert len(over) < SMALL.max_frame_bytes < len(over.encode())
    with pytest.raises(p.LimitExceeded, match="frame is larger than 200 bytes"):
        parse_frame(over, SMALL)
    with pytest.raises(p.LimitExceeded):
        parse_frame(b"x" * 201, SMALL)


def test_a_frame_over_the_limit_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(p.LimitExceeded, match="frame is larger"):
        parse_frame("[" * 300, SMALL)


def test_tool_output_over_the_limit_is_refused() -> None:
    assert isinstance(
        parse_frame(frame(type=p.TOOL_RESULT, toolCallId="c", output="x" * 40), SMALL), ToolResult
    )
    with pytest.raises(p.LimitExceeded, match="tool output is larger than 50 bytes"):
        parse_frame(frame(type=p.TOOL_RESULT, toolCallId="c", output={"k": "x" * 50}), SMALL)


def test_limit_exceeded_is_a_protocol_error() -> None:
    assert issubclass(p.LimitExceeded, ProtocolError)


def test_message_limits() -> None:
    p.check_message_limits({"id": "m", "role": "user", "parts": [{"type": "text"}] * 2}, SMALL)
    with pytest.raises(p.LimitExceeded, match="message 'm' has 3 parts; at most 2 are accepted"):
        p.check_message_limits({"id": "m", "role": "user", "parts": [{"type": "text"}] * 3}, SMALL)
    with pytest.raises(p.LimitExceeded, match="message 'm' is larger than 120 bytes"):
        p.check_message_limits(
            {"id": "m", "role": "user", "parts": [{"type": "text", "text": "é" * 50}]}, SMALL
        )


@pytest.mark.parametrize(
    ("output", "match"),
    [
        (r'"a\u0000b"', "NUL characters"),
        (r'["\ud800"]', "lone surrogates"),
        (r'"x\udfffy"', "lone surrogates"),
        (r'"\udc00\ud800"', "lone surrogates"),  # a pair in the wrong order
        (r'{"k\u0000": 1}', "NUL characters"),
        ("NaN", "finite"),
        ("[-Infinity]", "finite"),
        ("1e999", "finite"),
    ],
)
def test_what_postgres_cannot_store_is_refused(output: str, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_frame(f'{{"type":"{p.TOOL_RESULT}","toolCallId":"c","output":{output}}}')


def test_text_postgres_cannot_store_is_refused_inside_a_chat_request_body() -> None:
    message = {"id": "u", "role": "user", "parts": [{"type": "text", "text": "a\x00b"}]}
    with pytest.raises(ProtocolError, match="NUL characters"):
        parse_frame(chat_request({"messages": [message]}))
    with pytest.raises(ProtocolError, match="lone surrogates"):
        parse_frame(chat_request({"messages": [{**message, "id": "\udc00", "parts": []}]}))


def test_valid_surrogate_pairs_and_other_unicode_are_accepted() -> None:
    text = '{"type":"cf_agent_tool_result","toolCallId":"c","output":"\\ud83d\\ude00 \\u2028 é"}'
    parsed = parse_frame(text)
    assert isinstance(parsed, ToolResult) and parsed.output == "\U0001f600 \u2028 é"


@pytest.mark.parametrize("depth", [p.MAX_JSON_DEPTH, 5_000, 200_000])
def test_deeply_nested_json_is_a_protocol_error(depth: int) -> None:
    nested = "[" * depth + "]" * depth
    with pytest.raises(ProtocolError, match="nested"):
        parse_frame(f'{{"type":"{p.TOOL_RESULT}","toolCallId":"c","output":{nested}}}')
    with pytest.raises(ProtocolError, match="nested"):
        parse_frame(chat_request(f'{{"messages":[],"x":{nested}}}'))
    with pytest.raises(ProtocolError):
        parse_frame(nested)


def test_nesting_up_to_the_limit_is_accepted() -> None:
    depth = p.MAX_JSON_DEPTH - 1  # the output sits one level inside the frame
    nested = "[" * depth + "]" * depth
    assert isinstance(
        parse_frame(f'{{"type":"{p.TOOL_RESULT}","toolCallId":"c","output":{nested}}}'), ToolResult
    )


@pytest.mark.parametrize("role", [["user"], {"r": 1}, 1, None])
def test_a_role_of_the_wrong_type_is_a_protocol_error(role: Any) -> None:
    with pytest.raises(ProtocolError, match="'role' must be one of"):
        parse_frame(chat_request({"messages": [{"id": "m", "role": role}]}))


# -- refused_request_id: the id a refused chat request's error frame goes to --------------------------------
REAL_CLIENT_ORDER = (
    '{"id":"_7m9oTQg","init":{"method":"POST","body":"%s"},"type":"cf_agent_use_chat_request"}'
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (chat_request("{oops", request_id="bad1"), "bad1"),
        (REAL_CLIENT_ORDER % "{oops", "_7m9oTQg"),
        (REAL_CLIENT_ORDER % ("x" * 100_000), "_7m9oTQg"),  # refused for its size: only its ends are read
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": 'q"uo\\te', "init": 1}), 'q"uo\\te'),
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": "ünï 🙂", "init": 1}, ensure_ascii=False), "ünï 🙂"),
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": "ünï 🙂", "init": 1}), "ünï 🙂"),
        (json.dumps({"type": p.TOOL_RESULT, "id": "r"}), None),  # only chat requests have a stream to end
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": 7}), None),
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": ""}), None),
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": "r" * 256}), None),
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": "a\x00"}), None),  # cannot be sent back
        (json.dumps({"type": p.USE_CHAT_REQUEST, "id": "a\ud800"}), None),
        ('{"type":"cf_agent_use_chat_request","init":{"body":"{\\"id\\":\\"inner\\"}"}}', None),
        ("not json at all", None),
        ("", None),
    ],
)
def test_refused_request_id(text: str, expected: str | None) -> None:
    assert p.refused_request_id(text) == expected


# -- unknown and server-to-client types ----------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "{}",
        '{"type":null}',
        '{"type":"something_else","id":"x"}',
        '{"type":"CF_AGENT_CHAT_CLEAR"}',
        '{"type":"rpc","id":"1","method":"m","args":[]}',
        '{"type":"cf_agent_state","state":{}}',
        '{"type":"cf_agent_use_chat_response","id":"R","body":"","done":true}',
        '{"type":"cf_agent_use_chat_response","id":5}',
        '{"type":"cf_agent_stream_resuming","id":"R"}',
        '{"type":"cf_agent_stream_resume_none","reason":"idle"}',
        '{"type":"cf_agent_stream_pending","id":"R"}',
        '{"type":"cf_agent_message_updated","message":{}}',
        '{"type":"cf_agent_chat_recovering","recovering":true}',
        '{"type":"cf_agent_identity","name":"n","agent":"a"}',
    ],
)
def test_does_not_parse_server_to_client_or_unknown_types(text: str) -> None:
    assert parse_frame(text) is None


@pytest.mark.parametrize(
    "server_frame",
    [
        p.response_frame("R", "", done=True),
        p.stream_resuming_frame("R", "P"),
        p.stream_resume_none_frame("idle", "P"),
        p.stream_pending_frame("R", "P"),
        p.identity_frame("room", "chat-agent"),
        p.recovering_frame(True, "R"),
        p.message_updated_frame({"id": "m", "role": "assistant", "parts": []}),
        p.chunk_frame('"R"', '{"type":"start"}', 0),
    ],
)
def test_server_frames_are_never_parsed_as_input(server_frame: str) -> None:
    assert parse_frame(server_frame) is None


@pytest.mark.parametrize("text", ['{"type":["cf_agent_chat_clear"]}', '{"type":{"a":1}}'])
def test_unhashable_type_is_an_unknown_type(text: str) -> None:
    assert parse_frame(text) is None


# -- server frames ---------------------------------------------------------------------------------------
def test_stream_resume_none_authoritative_idle_golden() -> None:
    built = p.stream_resume_none_frame("idle", "dGlqGV_4")
    assert built == '{"type":"cf_agent_stream_resume_none","reason":"idle","probeId":"dGlqGV_4"}'


def test_stream_resume_none_variants() -> None:
    assert json.loads(p.stream_resume_none_frame()) == {"type": "cf_agent_stream_resume_none"}
    assert json.loads(p.stream_resume_none_frame("continuation-owned", "P")) == {
        "type": "cf_agent_stream_resume_none",
        "reason": "continuation-owned",
        "probeId": "P",
    }
    assert json.loads(p.stream_resume_none_frame(probe_id="P")) == {
        "type": "cf_agent_stream_resume_none",
        "probeId": "P",
    }
    assert json.loads(p.stream_resume_none_frame("idle")) == {
        "type": "cf_agent_stream_resume_none",
        "reason": "idle",
    }


def test_replay_done_frame_is_a_clean_close() -> None:
    built = p.response_frame("R", done=True, replay=True)
    assert json.loads(built) == {
        "type": "cf_agent_use_chat_response",
        "id": "R",
        "body": "",
        "done": True,
        "replay": True,
    }
    assert "error" not in json.loads(built)


def test_replay_done_frame_with_continuation() -> None:
    assert json.loads(p.response_frame("C", done=True, replay=True, continuation=True)) == {
        "type": "cf_agent_use_chat_response",
        "id": "C",
        "body": "",
        "done": True,
        "continuation": True,
        "replay": True,
    }


def test_terminal_error_frame_has_no_replay_flag() -> None:
    built = json.loads(p.response_frame("R", "prompt is too long", done=True, error=True))
    assert built == {
        "type": "cf_agent_use_chat_response",
        "id": "R",
        "body": "prompt is too long",
        "done": True,
        "error": True,
    }
    assert "replay" not in built


def test_replay_complete_frame() -> None:
    assert json.loads(p.response_frame("R", replay=True, replay_complete=True)) == {
        "type": "cf_agent_use_chat_response",
        "id": "R",
        "body": "",
        "done": False,
        "replay": True,
        "replayComplete": True,
    }


def test_plain_done_frame_golden() -> None:
    assert p.response_frame("_7m9oTQg", done=True) == (
        '{"type":"cf_agent_use_chat_response","id":"_7m9oTQg","body":"","done":true}'
    )


def test_response_frame_has_no_false_flags() -> None:
    built = json.loads(p.response_frame("R", '{"type":"start"}'))
    assert built == {
        "type": "cf_agent_use_chat_response",
        "id": "R",
        "body": '{"type":"start"}',
        "done": False,
    }


def test_response_frame_seq_and_outcome() -> None:
    assert json.loads(p.response_frame("R", seq=0)) == {
        "type": "cf_agent_use_chat_response",
        "id": "R",
        "body": "",
        "done": False,
        "seq": 0,
    }
    assert json.loads(p.response_frame("R", done=True, outcome="aborted"))["outcome"] == "aborted"
    assert "outcome" not in json.loads(p.response_frame("R", done=True))


def test_stream_pending_includes_the_id_only_when_present() -> None:
    assert json.loads(p.stream_pending_frame()) == {"type": "cf_agent_stream_pending"}
    assert json.loads(p.stream_pending_frame("R")) == {"type": "cf_agent_stream_pending", "id": "R"}
    assert json.loads(p.stream_pending_frame(probe_id="P")) == {
        "type": "cf_agent_stream_pending",
        "probeId": "P",
    }
    assert p.stream_pending_frame("R", "P") == '{"type":"cf_agent_stream_pending","id":"R","probeId":"P"}'


def test_stream_resuming_frame() -> None:
    assert p.stream_resuming_frame("_7m9oTQg") == '{"type":"cf_agent_stream_resuming","id":"_7m9oTQg"}'
    assert p.stream_resuming_frame("_7m9oTQg", "yn0rZcSI") == (
        '{"type":"cf_agent_stream_resuming","id":"_7m9oTQg","probeId":"yn0rZcSI"}'
    )


def test_identity_frame_golden() -> None:
    assert p.identity_frame("room-1", "my-think-agent") == (
        '{"type":"cf_agent_identity","name":"room-1","agent":"my-think-agent"}'
    )


def test_chat_messages_frame_golden() -> None:
    assert p.chat_messages_frame([]) == '{"type":"cf_agent_chat_messages","messages":[]}'
    messages = [{"id": "u-1", "role": "user", "parts": [{"type": "text", "text": "héllo"}]}]
    assert json.loads(p.chat_messages_frame(messages)) == {
        "type": "cf_agent_chat_messages",
        "messages": messages,
    }


def test_chat_clear_frame() -> None:
    assert p.chat_clear_frame() == '{"type":"cf_agent_chat_clear"}'


def test_recovering_frame() -> None:
    assert json.loads(p.recovering_frame(True, "R")) == {
        "type": "cf_agent_chat_recovering",
        "recovering": True,
        "id": "R",
    }
    assert json.loads(p.recovering_frame(False)) == {"type": "cf_agent_chat_recovering", "recovering": False}


def test_message_updated_frame() -> None:
    message = {"id": "a", "role": "assistant", "parts": [{"type": "tool-x", "state": "output-available"}]}
    assert json.loads(p.message_updated_frame(message)) == {
        "type": "cf_agent_message_updated",
        "message": message,
    }


def test_server_frames_keep_unicode_unescaped() -> None:
    built = p.response_frame("R", "日本語 🙂")
    assert "日本語 🙂" in built
    assert json.loads(built)["body"] == "日本語 🙂"


# -- chunk bodies and live chunk frames --------------------------------------------------------------------
CHUNKS = [
    {"type": "start", "messageId": "asst-_7m9oTQg"},
    {"type": "text-delta", "id": "t1", "delta": "four "},
    {"type": "text-delta", "id": "t1", "delta": "line one\nline two\r\n\ttab"},
    {"type": "text-delta", "id": "t1", "delta": 'she said "hi" and \\o/'},
    {"type": "text-delta", "id": "t1", "delta": "héllo — 日本語 🙂👍🏽 \u2028\u2029 \x00"},
    {"type": "tool-input-available", "toolCallId": "c", "toolName": "x", "input": {"k\n": ["\n", 1.5, None]}},
    {"type": "finish", "finishReason": "stop", "messageMetadata": {"usage": {"totalTokens": 3}}},
]


def test_stored_chunks_and_frames_share_one_encoder() -> None:
    """The stream buffer's bodies (the hot path) and the codec's frames are encoded by the same function,
    so the tests below hold for both."""
    import recovery.stream.buffer

    assert recovery.stream.buffer.dumps is dumps and p.dumps is dumps


@pytest.mark.parametrize("chunk", CHUNKS)
def test_a_chunk_body_is_compact_json_without_raw_newlines(chunk: dict[str, Any]) -> None:
    body = dumps(chunk)
    assert "\n" not in body and "\r" not in body
    assert json.loads(body) == chunk
    assert body == json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)


def test_a_chunk_body_escapes_newlines_in_delta() -> None:
    body = dumps({"type": "text-delta", "id": "t1", "delta": "a\nb"})
    assert body == '{"type":"text-delta","id":"t1","delta":"a\\nb"}'


def test_a_chunk_body_keeps_non_ascii() -> None:
    body = dumps({"type": "text-delta", "id": "t1", "delta": "日本 🙂"})
    assert "日本 🙂" in body


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("continuation", [False, True])
@pytest.mark.parametrize("request_id", ["_7m9oTQg", 'id "with" quotes\\', "ünï-🙂", "x\ny"])
@pytest.mark.parametrize("seq", [0, 7, 123456])
def test_chunk_frame_matches_response_frame(
    chunk: dict[str, Any], continuation: bool, request_id: str, seq: int
) -> None:
    body = dumps(chunk)
    live = p.chunk_frame(json.dumps(request_id), body, seq, continuation=continuation)
    reference = p.response_frame(request_id, body, seq=seq, continuation=continuation)
    assert json.loads(live) == json.loads(reference)
    assert "\n" not in live
    assert json.loads(json.loads(live)["body"]) == chunk


def test_chunk_frame_golden() -> None:
    body = dumps({"type": "text-delta", "id": "t1", "delta": "four "})
    assert p.chunk_frame('"_7m9oTQg"', body, 3) == (
        '{"type":"cf_agent_use_chat_response","id":"_7m9oTQg",'
        '"body":"{\\"type\\":\\"text-delta\\",\\"id\\":\\"t1\\",\\"delta\\":\\"four \\"}",'
        '"done":false,"seq":3}'
    )


def test_chunk_frame_continuation_flag() -> None:
    built = json.loads(p.chunk_frame('"C"', "{}", 1, continuation=True))
    assert built["continuation"] is True
    assert built["done"] is False
    assert "continuation" not in json.loads(p.chunk_frame('"C"', "{}", 1))
