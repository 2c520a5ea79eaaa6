"""A conversation of any length opens, continues and streams (issue 21, item 7).

8,000 stored messages (about 1.5 MB) are inserted directly; a real daphne and worker serve them.
Before the transcript was windowed, connecting sent the whole history in one frame, daphne's
autobahn refused to send a message over its 1 MiB limit (PayloadExceededError), and daphne closed
the socket with 1011 on every connect.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import websockets
from asgiref.sync import sync_to_async

from chat.transcript.selectors import messages_list
from tests.support import (
    TEST_PRINCIPAL,
    ChatClient,
    auth_headers,
    chat_request,
    numbers,
    start_daphne,
    user_message,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

DAPHNE_MAX_MESSAGE = 1024 * 1024  # daphne's default websocket_max_message_size
LONG = 8_000
UNCOMPACTED = "tool-agent"  # an agent without a compaction function
FILLER = "The customer asked about the order and the assistant explained the schedule. "


def text_of(i: int, repeat: int = 1) -> str:
    return f"m{i}: {FILLER * repeat}"


def grow(name: str, count: int = LONG, agent: str = "assistant", repeat: int = 1) -> int:
    """A conversation of `count` stored messages (about 190 bytes of JSON each, more with `repeat`),
    alternating roles."""
    from chat.agents import open_agent
    from chat.models import Message

    conversation_id = open_agent(agent, name, owner=TEST_PRINCIPAL).conversation_id
    Message.objects.bulk_create(
        Message(
            conversation_id=conversation_id,
            message_id=f"h{i}",
            role="user" if i % 2 == 0 else "assistant",
            parts=[{"type": "text", "text": text_of(i, repeat)}],
            position=i,
        )
        for i in range(count)
    )
    return conversation_id


def new_name() -> str:
    return f"long-{uuid.uuid4().hex[:8]}"


async def first_transcript(client: ChatClient) -> tuple[dict[str, Any], int]:
    """The connect transcript frame and its size in bytes."""
    raw = await client.ws.recv()
    frame = json.loads(raw)
    client.frames.append(frame)
    assert frame["type"] == "cf_agent_chat_messages", frame["type"]
    return frame, len(raw.encode() if isinstance(raw, str) else raw)


async def test_a_long_conversation_opens(stack: Any) -> None:
    name = new_name()
    await sync_to_async(grow)(name)
    async with ChatClient(stack.port, name) as client:
        try:
            frame, size = await first_transcript(client)
        except websockets.ConnectionClosed as closed:
            pytest.fail(f"the socket closed with {closed.rcvd.code if closed.rcvd else None} on connect")
        assert size < DAPHNE_MAX_MESSAGE
        identity = await client.recv_type("cf_agent_identity")
        assert identity["name"] == name
    messages = frame["messages"]
    assert messages and messages[-1]["id"] == f"h{LONG - 1}", "the window ends with the latest message"


def get_messages(
    port: int, name: str, query: str = "", agent: str = "assistant"
) -> tuple[list[dict[str, Any]], bool]:
    url = f"http://127.0.0.1:{port}/agents/{agent}/{name}/get-messages{query}"
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=30) as r:
        return json.loads(r.read()), r.headers["Think-Earlier"] == "true"


def stored_ids(name: str) -> list[str]:
    from chat.models import Message

    rows = Message.objects.filter(conversation__name=name).order_by("position")
    return list(rows.values_list("message_id", flat=True))


async def test_a_long_conversation_continues_regenerates_and_pages(stack: Any, scripted_model: Any) -> None:
    """With an agent that does not compact (the demo's does: the next test), the model reads every stored
    message although the client holds a window of them."""
    name = new_name()
    await sync_to_async(grow)(name, agent=UNCOMPACTED)
    async with ChatClient(stack.port, name, UNCOMPACTED) as client:
        frame, _ = await first_transcript(client)
        window = frame["messages"]
        assert frame.get("earlier") is True and len(window) < LONG
        # The client holds the window only and asks for more, as the published hook does.
        prompt = f"count to 5 {name}"
        await client.send(chat_request("r1", [*window, user_message(prompt, "u-new")]))
        log = await client.follow("r1", timeout=60)
        assert log.errors == [] and log.text == numbers(5)
        after = await client.recv_type("cf_agent_chat_messages")
    [chat] = [c for c in scripted_model.chats if c and c[-1].get("content") == prompt]
    texts = [m.get("content") for m in chat if m["role"] != "system"]
    assert texts[:2] == [text_of(0), text_of(1)], "the model read the oldest messages, not just the window"
    assert len([t for t in texts if isinstance(t, str) and t.startswith("m")]) == LONG
    ids = await sync_to_async(stored_ids)(name)
    assert ids[:LONG] == [f"h{i}" for i in range(LONG)] and ids[LONG] == "u-new" and len(ids) == LONG + 2
    assert after["messages"][-1]["id"] == ids[-1] and len(json.dumps(after)) < DAPHNE_MAX_MESSAGE

    # Regenerate the answer from the window the client now holds (the hook drops the last answer).
    kept = [m for m in after["messages"] if m["id"] != ids[-1]]
    before = len(scripted_model.chats)
    async with ChatClient(stack.port, name, UNCOMPACTED) as client:
        await first_transcript(client)
        await client.send(chat_request("r2", kept, trigger="regenerate-message"))
        log = await client.follow("r2", timeout=60)
    assert log.errors == [] and log.text == numbers(5)
    regenerated = await sync_to_async(stored_ids)(name)
    assert regenerated[: LONG + 1] == ids[: LONG + 1] and len(regenerated) == LONG + 2
    assert regenerated[-1] != ids[-1], "a new answer in place of the old one"
    again = [m.get("content") for m in scripted_model.chats[before] if m["role"] != "system"]
    assert again[:1] == [text_of(0)] and again[-1] == prompt

    # Paging back from the window reaches the first message: every stored message once, in order.
    page, earlier = await sync_to_async(get_messages)(stack.port, name, "", UNCOMPACTED)
    pages = [page]
    while earlier:
        page, earlier = await sync_to_async(get_messages)(
            stack.port, name, f"?before={pages[0][0]['id']}&limit=1000", UNCOMPACTED
        )
        assert page, "a page before a message that has older ones is never empty"
        pages.insert(0, page)
    assert [m["id"] for p in pages for m in p] == regenerated


async def test_the_demo_agent_compacts_a_long_history_before_its_model_refuses_it(
    stack: Any, scripted_model: Any
) -> None:
    """Issue 36, item 7: 8,000 stored messages (about 450,000 tokens as the session counts them) against a
    model with a 128,000-token window (the demo model's declared one): the demo agent compacts before the
    model call, so the provider never refuses the turn, and it answers."""
    from chat.models import Compaction
    from think_scripted.kwargs import CONTEXT_WINDOW
    from think_scripted.server import count_prompt_tokens, is_summary_request

    name = new_name()
    await sync_to_async(grow)(name, repeat=2)  # the summary's request is over 1 MiB: the model takes it
    prompt = f"count to 5 [window {CONTEXT_WINDOW}] {name}"
    before = len(scripted_model.chats)
    async with ChatClient(stack.port, name) as client:
        frame, _ = await first_transcript(client)
        await client.send(chat_request("r1", [*frame["messages"], user_message(prompt, "u-new")]))
        log = await client.follow("r1", timeout=120)
    assert log.errors == [] and log.done is not None and log.done["outcome"] == "completed"
    assert log.text == numbers(5)
    chats = scripted_model.chats[before:]
    [summary] = [c for c in chats if is_summary_request(c)]
    assert count_prompt_tokens(summary) > CONTEXT_WINDOW, "the summary read what the window would not take"
    [answered] = [c for c in chats if c and c[-1].get("content") == prompt]  # once: no refusal, no retry
    assert count_prompt_tokens(answered) <= CONTEXT_WINDOW
    texts = [m.get("content") for m in answered if m["role"] != "system"]
    assert len(json.dumps(summary)) > 1024 * 1024
    assert texts[:3] == [text_of(0, 2), text_of(1, 2), text_of(2, 2)], "the head is kept"
    assert str(texts[3]).startswith("Summary of "), "the middle is summarised"
    assert texts[-2] == text_of(LONG - 1, 2), "the tail ends with the newest stored message"
    assert await Compaction.objects.filter(conversation__name=name).acount() == 1


async def test_a_chat_request_over_the_frame_limit_is_refused_with_a_reason(stack: Any) -> None:
    name = new_name()
    conversation_id = await sync_to_async(grow)(name)
    history = await sync_to_async(messages_list)(conversation_id=conversation_id)
    # A client that kept the whole history (over MAX_FRAME_BYTES, under daphne's 1 MiB): refused, with why.
    held = 5_000
    frame = chat_request("big", [*history[-held:], user_message("count to 3", "u-big")])
    while len(frame.encode()) <= 1_010_000:
        held += 100
        frame = chat_request("big", [*history[-held:], user_message("count to 3", "u-big")])
    assert 1_000_000 < len(frame.encode()) < DAPHNE_MAX_MESSAGE, len(frame.encode())
    async with ChatClient(stack.port, name) as client:
        await first_transcript(client)
        await client.send(frame)
        log = await client.follow("big", timeout=30)
    assert log.done is not None and log.errors == ["Invalid chat request: frame is larger than 1000000 bytes"]
    assert await sync_to_async(stored_ids)(name) == [f"h{i}" for i in range(LONG)], "nothing stored"


SMALL_SEND_LIMIT = 120_000


@pytest.fixture
def small_frames(stack: Any, log_dir: Any) -> Iterator[int]:
    """A daphne of the shared stack whose largest WebSocket message is 120,000 bytes (THINK
    MAX_SEND_BYTES), so a tool output and a transcript of ordinary size are over it; the shared worker
    runs its turns."""
    daphne, port = start_daphne({**stack.env, "THINK_TEST_MAX_SEND_BYTES": str(SMALL_SEND_LIMIT)}, log_dir)
    yield port
    daphne.stop()


async def test_frames_over_the_send_limit_go_out_smaller_and_the_socket_stays_open(small_frames: int) -> None:
    """A 150,000-character tool output is one chunk: its live frame is over the limit, so it goes out
    as a transient placeholder with its seq (chat.wire.oversize) while the stored message keeps it whole.
    The model repeats it as one 150,000-character word: its delta leaves in pieces of at most 64,000
    characters (chat.turn.chunking.coalesce). The transcript after the turn is over the limit too, and
    carries the message cut for display. Sent whole, any of them would make daphne close with 1011."""
    size = 150_000
    name = new_name()
    prompt = f'[tool bulky {{"tag": "{name}", "size": {size}}}]'
    async with ChatClient(small_frames, name, agent="tool-agent") as client:
        await first_transcript(client)
        await client.send(chat_request("bulky", [user_message(prompt, "u-bulky")]))
        try:
            log = await client.follow("bulky", timeout=60)
            transcript = await client.recv_type("cf_agent_chat_messages", timeout=30)
        except websockets.ConnectionClosed as closed:
            pytest.fail(f"the socket closed with {closed.rcvd.code if closed.rcvd else None} mid-stream")
        sizes = [
            len(json.dumps(frame, separators=(",", ":"), ensure_ascii=False).encode())
            for frame in client.frames
        ]
    assert max(sizes) <= SMALL_SEND_LIMIT, max(sizes)
    assert log.done is not None and log.done.get("outcome") == "completed", log.done
    kinds = [chunk["type"] for _, chunk in log.chunks]
    omitted = [(seq, chunk) for seq, chunk in log.chunks if chunk["type"] == "data-think-omitted"]
    assert len(omitted) == 1 and omitted[0][1]["data"]["reason"] == "too_large", kinds
    assert "tool-output-available" not in kinds, "the oversized output went out whole"
    assert log.seqs == list(range(len(log.chunks))), "the placeholder kept its place in the stream"
    deltas = [chunk["delta"] for _, chunk in log.chunks if chunk["type"] == "text-delta"]
    assert log.text == f"Tool bulky returned: {'x' * size}"
    assert max(len(delta) for delta in deltas) <= 64_000 and len(deltas) >= 3
    stored = (await sync_to_async(messages_list)(conversation_id=await sync_to_async(conversation_of)(name)))[
        -1
    ]
    tool_part = next(part for part in stored["parts"] if part["type"] == "tool-bulky")
    assert tool_part["state"] == "output-available" and tool_part["output"] == "x" * size, "stored whole"
    shown = transcript["messages"][-1]
    assert shown["id"] == stored["id"] and "thinkTruncated" in shown["metadata"], "shown cut for display"


def conversation_of(name: str) -> int:
    from chat.models import Conversation

    return Conversation.objects.get(name=name).pk
