"""Bad input, generated: the codec only ever returns a frame, None, or raises ProtocolError; what it
accepts Postgres can store; and the consumer survives anything, answering refused chat requests with an
error frame and changing nothing stored for a refused frame."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from chat import protocol as p
from chat.exceptions import ProtocolError
from chat.protocol import ChatRequest, Clear, Limits, parse_frame, refused_request_id
from tests.chat.sockets import connected, new_name, probe, seed_conversation, stored_state

FRAME_TYPES = (
    p.ChatRequest,
    p.Cancel,
    p.Clear,
    p.ResumeRequest,
    p.ResumeAck,
    p.ToolResult,
    p.ToolApproval,
    p.ClientMessages,
)
OTHER_TYPES = [
    p.USE_CHAT_RESPONSE,
    p.STREAM_RESUMING,
    p.IDENTITY,
    "rpc",
    "cf_agent_state",
    "CF_AGENT_CHAT_CLEAR",
]
TRICKY = [
    "",
    "\x00",
    "a\x00b",
    "\ud800",
    "\udfff",
    "x\ud83d",
    "\ud83d\ude00",
    "\u2028",
    "\ufeff",
    "é",
    "𝕏",
    "\\",
]
SMALL_LIMITS = Limits(
    max_frame_bytes=4_000, max_message_bytes=600, max_message_parts=3, max_tool_output_bytes=300
)

# -- strategies ------------------------------------------------------------------------------------------
any_char = st.characters(codec=None, exclude_categories=())  # lone surrogates included
text = st.one_of(st.text(max_size=12), st.text(any_char, max_size=12), st.sampled_from(TRICKY))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=16,
)
huge = st.tuples(st.integers(0, 120_000), st.sampled_from(["x", "é", "🙂", "\x00", "\ud800"])).map(
    lambda size_char: size_char[1] * size_char[0]
)


def nested(depth: int, leaf: Any = 1) -> Any:
    for level in range(depth):
        leaf = [leaf] if level % 2 else {"k": leaf}
    return leaf


deep = st.integers(1, 600).map(nested)  # json.dumps itself recurses: deeper ones are written as text
values = st.one_of(json_values, json_values, json_values, huge, deep)


def mostly(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Usually a plausible value, sometimes any JSON at all: frames that are wrong in one place."""
    return st.one_of(good, good, good, values)


ids = mostly(st.sampled_from(["r-1", "call-1", "call-unknown", "x" * 255, "x" * 256]) | text)
tool_lists = mostly(st.lists(st.fixed_dictionaries({"name": text}), max_size=2))
parts = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(["text", "reasoning", "step-start", "tool-x"]))},
    optional={"text": text | huge, "toolCallId": ids, "state": text, "output": values},
)
messages = st.fixed_dictionaries(
    {"id": ids, "role": mostly(st.sampled_from(["user", "assistant", "system", "tool"]))},
    optional={
        "parts": mostly(st.lists(parts, max_size=5)),
        "metadata": mostly(st.dictionaries(text, values)),
    },
)
bodies = st.fixed_dictionaries(
    {"messages": mostly(st.lists(messages, max_size=3))},
    optional={
        "trigger": mostly(st.sampled_from(["submit-message", "regenerate-message", "x"])),
        "clientTools": tool_lists,
        "custom": values,
    },
)


def encode(value: Any, ensure_ascii: bool) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii)


inits = st.fixed_dictionaries(
    {"body": mostly(st.builds(encode, bodies, st.booleans()))},
    optional={"method": st.sampled_from(["POST", "POST", "GET", None, 1])},
)
states = mostly(st.sampled_from(["output-available", "output-error", "input-available"]))
chat_requests = st.fixed_dictionaries({"type": st.just(p.USE_CHAT_REQUEST), "id": ids, "init": mostly(inits)})
typed_frames = st.one_of(
    chat_requests,
    st.fixed_dictionaries(
        {"type": st.just(p.TOOL_RESULT), "toolCallId": ids},
        optional={"toolName": ids, "output": values, "state": states, "errorText": mostly(text)}
        | {"autoContinue": mostly(st.booleans()), "clientTools": tool_lists},
    ),
    st.fixed_dictionaries(
        {"type": st.just(p.TOOL_APPROVAL), "toolCallId": ids, "approved": mostly(st.booleans())},
        optional={"autoContinue": values},
    ),
    st.fixed_dictionaries({"type": st.sampled_from([p.CHAT_REQUEST_CANCEL, p.STREAM_RESUME_ACK]), "id": ids}),
    st.fixed_dictionaries({"type": st.just(p.STREAM_RESUME_REQUEST)}, optional={"probeId": ids}),
    st.fixed_dictionaries(
        {"type": st.just(p.CHAT_MESSAGES), "messages": mostly(st.lists(messages, max_size=3))}
    ),
    st.fixed_dictionaries({"type": st.just(p.CHAT_CLEAR)}, optional={"id": ids}),
    st.fixed_dictionaries({"type": st.sampled_from(OTHER_TYPES) | json_values}, optional={"id": ids}),
)
frame_objects = st.one_of(typed_frames, typed_frames, typed_frames, json_values, deep)
frame_texts = st.builds(encode, frame_objects, st.booleans())


def mutate(source: str, at: int, how: str, extra: str) -> str:
    at = at % (len(source) + 1)
    if how == "cut":
        return source[:at]
    if how == "drop":
        return source[:at] + source[at + 1 :]
    return source[:at] + extra + source[at:]


mutated = st.builds(
    mutate, frame_texts, st.integers(0, 10_000), st.sampled_from(["cut", "drop", "insert"]), text
)


def deep_texts(most: int) -> st.SearchStrategy[str]:
    return st.integers(1, most).map(lambda n: "[" * n + "]" * n) | st.integers(1, most).map(
        lambda n: '{"type":"cf_agent_tool_result","toolCallId":"c","output":' + "[" * n + "]" * n + "}"
    )


inputs = st.one_of(
    frame_texts,
    frame_texts,
    st.builds(encode, chat_requests, st.booleans()),
    mutated,
    deep_texts(100_000),
    st.text(any_char) | st.binary(),
)


# -- the codec -------------------------------------------------------------------------------------------
def parse_outcome(data: str | bytes, limits: Limits) -> p.Frame | None:
    """parse_frame's answer, with ProtocolError as None: anything else escapes and fails the test."""
    try:
        result = parse_frame(data, limits)
    except ProtocolError:
        return None
    assert result is None or isinstance(result, FRAME_TYPES), result
    return result


@settings(max_examples=600, deadline=None, database=None)
@given(data=inputs, limits=st.sampled_from([p.DEFAULT_LIMITS, SMALL_LIMITS]))
def test_parse_frame_returns_a_frame_or_none_or_raises_protocol_error(
    data: str | bytes, limits: Limits
) -> None:
    parse_outcome(data, limits)


@settings(max_examples=300, deadline=None, database=None)
@given(data=inputs)
def test_refused_request_id_is_a_short_clean_string_or_none(data: str | bytes) -> None:
    text_data = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    request_id = refused_request_id(text_data)
    if request_id is not None:
        assert 0 < len(request_id) <= p.MAX_ID_LENGTH
        assert "\x00" not in request_id
        request_id.encode("utf-8")


@pytest.mark.django_db
@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=inputs)
def test_what_parse_frame_accepts_postgres_can_store(data: str | bytes) -> None:
    frame = parse_outcome(data, p.DEFAULT_LIMITS)
    if frame is None:
        return
    stored = {k: v for k, v in vars(frame).items() if not isinstance(v, bool)}
    with connection.cursor() as cursor:
        cursor.execute("SELECT %s::jsonb", [Jsonb(stored)])


# -- the consumer ----------------------------------------------------------------------------------------
SEED = [
    {"id": "u-1", "role": "user", "parts": [{"type": "text", "text": "hi"}]},
    {
        "id": "a-1",
        "role": "assistant",
        "parts": [
            {"type": "tool-x", "toolCallId": "call-1", "state": "output-available", "input": {}, "output": 1}
        ],
    },
]
FUZZ_THINK = {
    **django_settings.THINK,
    "MAX_FRAME_BYTES": SMALL_LIMITS.max_frame_bytes,
    "MAX_MESSAGE_BYTES": SMALL_LIMITS.max_message_bytes,
    "MAX_MESSAGE_PARTS": SMALL_LIMITS.max_message_parts,
    "MAX_TOOL_OUTPUT_BYTES": SMALL_LIMITS.max_tool_output_bytes,
    "MAX_FRAMES_PER_S": 10_000.0,
    "MAX_FRAME_BURST": 10_000,
}
socket_inputs = st.one_of(frame_texts, mutated, deep_texts(3_000), st.text(any_char))


def changes_state(data: str) -> bool:
    """Frames that are meant to change what is stored (a clear, a chat request) stay out of the fuzz."""
    return isinstance(parse_outcome(data, SMALL_LIMITS), Clear | ChatRequest)


@pytest.mark.django_db(transaction=True)
@settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=st.lists(socket_inputs, min_size=1, max_size=6))
async def test_the_consumer_survives_any_frame_and_a_refused_one_changes_nothing(frames: list[str]) -> None:
    frames = [f for f in frames if not changes_state(f)]
    name = new_name("fuzz")
    conversation_id = await seed_conversation(name, SEED)
    with override_settings(THINK=FUZZ_THINK), mock.patch("chat.transcript.turns.turn_enqueue") as enqueue:
        async with connected(name) as socket:
            for number, data in enumerate(frames):
                before = await stored_state(conversation_id)
                await socket.send_input({"type": "websocket.receive", "text": data})  # "" too
                # Answered: the frame was handled, the consumer is alive and the socket open.
                answer, _ = await probe(socket, f"probe-{number}")
                assert (answer["type"], answer["reason"]) == (p.STREAM_RESUME_NONE, "idle")
                after = await stored_state(conversation_id)
                if parse_outcome(data, SMALL_LIMITS) is None:  # refused or ignored: nothing at all changes
                    assert after == before
                else:  # accepted: a tool answer for a settled or unknown call, a cancel, a probe...
                    assert after["messages"] == before["messages"] and after["fibers"] == before["fibers"]
        assert not enqueue.called


def defective_request(defect: str, request_id: str, big: int) -> dict[str, Any]:
    """A chat request that must be refused, for the reason `defect` names."""
    message: dict[str, Any] = {"id": "new-1", "role": "user", "parts": [{"type": "text", "text": "hello"}]}
    body: dict[str, Any] = {"messages": [*SEED, message], "trigger": "submit-message"}
    init: dict[str, Any] = {"method": "POST"}
    if defect == "method":
        init["method"] = "GET"
    elif defect == "role":
        message["role"] = ["user"]
    elif defect == "trigger":
        body["trigger"] = "resubmit"
    elif defect in ("\x00", "\ud800"):
        message["parts"][0]["text"] = f"a{defect}b"
    elif defect == "nan":
        message["metadata"] = {"score": float("nan")}
    elif defect == "deep":
        message["metadata"] = nested(big % 500 + p.MAX_JSON_DEPTH)
    elif defect == "parts":
        message["parts"] = [
            {"type": "text", "text": str(n)} for n in range(SMALL_LIMITS.max_message_parts + 1)
        ]
    elif defect == "message":
        message["parts"][0]["text"] = "m" * (SMALL_LIMITS.max_message_bytes + big % 1_000)
    elif defect == "frame":
        body["custom"] = "f" * (SMALL_LIMITS.max_frame_bytes + big)
    init["body"] = "{not json" if defect == "body" else json.dumps(body)
    return {"id": request_id, "init": init, "type": p.USE_CHAT_REQUEST}


DEFECTS = ["method", "role", "trigger", "\x00", "\ud800", "nan", "deep", "parts", "message", "frame", "body"]


@pytest.mark.django_db(transaction=True)
@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    defect=st.sampled_from(DEFECTS),
    # Any id the server can echo back: one with NUL or a lone surrogate gets no frame (it cannot be sent).
    request_id=st.text(
        st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), min_size=1, max_size=40
    ),
    big=st.integers(0, 100_000),
    type_first=st.booleans(),
)
async def test_a_refused_chat_request_gets_an_error_frame_and_stores_nothing(
    defect: str, request_id: str, big: int, type_first: bool
) -> None:
    frame = defective_request(defect, request_id, big)
    if type_first:  # the real client writes id, init, type; other clients may start with the type
        frame = {"type": frame.pop("type"), **frame}
    name = new_name("refused")
    conversation_id = await seed_conversation(name, SEED)
    with override_settings(THINK=FUZZ_THINK), mock.patch("chat.transcript.turns.turn_enqueue") as enqueue:
        async with connected(name) as socket:
            before = await stored_state(conversation_id)
            await socket.send_to(text_data=json.dumps(frame, ensure_ascii=False, allow_nan=True))
            _, frames = await probe(socket)
            [error] = [f for f in frames if f["type"] == p.USE_CHAT_RESPONSE]
            assert error["id"] == request_id and error["done"] is True and error["error"] is True
            assert error["body"].startswith(("Invalid chat request: ", "Chat request refused: "))
            assert await stored_state(conversation_id) == before
    assert not enqueue.called
