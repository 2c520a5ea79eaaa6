"""The published JavaScript client against a live daphne + Celery stack.

tests/js/scenarios.mjs runs the npm packages `agents` (AgentClient, WebSocketChatTransport) and `ai`
(readUIMessageStream) unmodified, wired the way the useAgentChat hook wires them, and prints what it saw;
these tests assert on that and on what the server stored. The worker-kill scenario is in
test_js_client_recovery.py (recovery_stack: its own workers and queue).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from chat.transcript.snapshot import TurnKind
from recovery.models import Fiber, Segment
from tests.agents import tool_runs
from tests.e2e.js_client import (
    chunk_seqs,
    frames,
    frames_text,
    get_messages,
    message_text,
    new_name,
    node_with_packages,
    run_scenario,
    tab,
)
from tests.support import TEST_PRINCIPAL, numbers

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TOOL_AGENT = "tool-agent"


@pytest.fixture(scope="session")
def node() -> str:
    """Node.js with tests/js installed (npm ci from the lock file when needed)."""
    return node_with_packages()


def sent(tab_report: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [f for f in tab_report["sent"] if f["type"] == kind]


def test_connect_identity_and_idle_probe(stack: Any, node: str) -> None:
    name = new_name("connect")
    result = run_scenario(node, stack.port, "assistant", name, "connect")
    me = tab(result)
    assert result["identity"] == {"name": name, "agent": "assistant", "identified": True}
    [identity] = frames(me, "cf_agent_identity")
    assert "stateFollows" not in identity, "ready would wait for a cf_agent_state that never comes"
    assert result["probe"]["isNull"] is True
    assert result["probe"]["ms"] < 2000, "answered by the server, not by the client's 5 s probe timeout"
    [probe] = sent(me, "cf_agent_stream_resume_request")
    [none] = frames(me, "cf_agent_stream_resume_none")
    assert none == {**none, "reason": "idle", "probeId": probe["probeId"]}, "authoritative idle, correlated"


def test_a_streamed_turn_folds_to_the_stored_message(stack: Any, node: str) -> None:
    name = new_name("turn")
    result = run_scenario(node, stack.port, "assistant", name, "turn", prompt="count to 30")
    folded = result["folded"]
    assert folded["errors"] == []
    assert folded["text"] == numbers(30)
    assert folded["chunkTypes"][:3] == ["start", "start-step", "text-start"]
    assert folded["chunkTypes"][-3:] == ["text-end", "finish-step", "finish"]
    response = frames(tab(result), "cf_agent_use_chat_response", id=result["requestId"])
    assert chunk_seqs(response) == list(range(len(response) - 1))
    assert response[-1]["done"] is True and response[-1]["outcome"] == "completed"

    transcript = get_messages(stack.port, "assistant", name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert transcript[0]["id"] == result["userId"]
    assert transcript[1]["id"] == folded["message"]["id"], "start.messageId is the id get-messages returns"
    assert message_text(transcript[1]) == numbers(30)
    assert [m["id"] for m in result["broadcast"]] == [m["id"] for m in transcript]


def test_a_dropped_socket_resumes_without_gap_or_duplicate(stack: Any, node: str) -> None:
    name = new_name("resume")
    result = run_scenario(
        node, stack.port, "assistant", name, "resume", prompt="count to 80 [rate 40]", dropAfter=10
    )
    request_id = result["requestId"]
    me = tab(result)
    first, second = result["first"], result["second"]
    # The local stream ends when the socket closes (agents 0.32: an error chunk, the turn goes on).
    assert first["errors"] == ["WebSocket closed mid-stream"]
    assert numbers(80).startswith(first["text"]) and len(first["text"].split()) >= 10
    assert first["text"] != numbers(80)

    # On the new socket (same _pk): resuming twice (on connect, and as the probe's answer), one ACK.
    [ack] = sent(me, "cf_agent_stream_resume_ack")
    assert ack == {**ack, "id": request_id, "gen": 2}
    resuming = [f for f in frames(me, "cf_agent_stream_resuming", id=request_id) if f["gen"] == 2]
    assert len(resuming) == 2
    assert result["probeMs"] < 2000

    # Replay from chunk 0, then replayComplete, then the live tail: every seq exactly once.
    response = [f for f in frames(me, "cf_agent_use_chat_response", id=request_id) if f["gen"] == 2]
    replayed = [f for f in response if f.get("replay") and isinstance(f["body"], dict)]
    assert len(replayed) >= len(first["chunkTypes"]) - 1
    [complete] = [f for f in response if f.get("replayComplete")]
    assert response.index(complete) == len(replayed), "replayComplete comes right after the replay"
    assert chunk_seqs(response) == list(range(len(response) - 2))
    assert response[-1]["done"] is True and response[-1]["outcome"] == "completed"

    # The resumed fold replaces the partial (same messageId) and holds every number once.
    assert second["errors"] == []
    assert second["text"] == numbers(80)
    assert second["message"]["id"] == first["message"]["id"]
    assert result["activeAfter"] is None
    transcript = get_messages(stack.port, "assistant", name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert transcript[1]["id"] == second["message"]["id"]
    assert message_text(transcript[1]) == numbers(80)


def test_cancel_ends_the_stream_and_keeps_the_partial(stack: Any, node: str) -> None:
    name = new_name("cancel")
    result = run_scenario(
        node, stack.port, "assistant", name, "cancel", prompt="count to 300 [rate 30]", cancelAfter=5
    )
    request_id = result["requestId"]
    me = tab(result)
    folded = result["folded"]
    assert result["cancelled"] is True and result["activeAfter"] is None
    assert [f["id"] for f in sent(me, "cf_agent_chat_request_cancel")] == [request_id]
    assert folded["errors"] == ["Aborted"], "cancelActiveServerTurn ends the local stream at once"
    assert len(folded["text"].split()) >= 5 and numbers(300).startswith(folded["text"])

    done = result["done"]
    assert done["done"] is True and not done.get("error") and done["outcome"] == "aborted"
    delivered = frames_text(frames(me, "cf_agent_use_chat_response", id=request_id))
    assert delivered.startswith(folded["text"]) and numbers(300).startswith(delivered)
    assert len(delivered) < len(numbers(300))

    transcript = get_messages(stack.port, "assistant", name)
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert transcript[1]["id"] == folded["message"]["id"]
    assert message_text(transcript[1]) == delivered, "the stored partial is what the socket delivered"
    assert [message_text(m) for m in result["broadcast"]] == [message_text(m) for m in transcript]
    assert Fiber.objects.get(request_id=request_id).status == Fiber.Status.CANCELLED


def assert_continuation_handshake(me: dict[str, Any], result: dict[str, Any]) -> None:
    """expectToolContinuation + reconnectToStream: one probe, answered pending or resuming (never an
    authoritative idle while the continuation exists), then one ACK for the continuation."""
    [probe] = sent(me, "cf_agent_stream_resume_request")
    answers = [
        f
        for f in me["received"]
        if f.get("probeId") == probe["probeId"]
        and f["type"]
        in ("cf_agent_stream_pending", "cf_agent_stream_resuming", "cf_agent_stream_resume_none")
    ]
    acks = sent(me, "cf_agent_stream_resume_ack")
    assert result["via"] == "transport", f"the probe was answered {[a['type'] for a in answers]}"
    assert answers and answers[-1]["type"] in ("cf_agent_stream_pending", "cf_agent_stream_resuming")
    assert [a["id"] for a in acks] == [result["continuationId"]]


CLIENT_TOOLS = [
    {
        "name": "get_location",
        "description": "The user's location, from the browser.",
        "parameters": {"type": "object", "properties": {}},
    }
]


def test_a_client_tool_round_trip(stack: Any, node: str) -> None:
    name = new_name("client-tool")
    output = {"city": "Lisbon", "nonce": uuid.uuid4().hex[:6]}
    # "ToolAgent": the client's own kebab-casing must reach /agents/tool-agent/...
    result = run_scenario(
        node,
        stack.port,
        "ToolAgent",
        name,
        "clientTool",
        prompt="[tool get_location {}] [rate 20]",  # paced: the continuation still runs at the ACK
        tool="get_location",
        output=output,
        clientTools=CLIENT_TOOLS,
    )
    me = tab(result)
    [identity] = frames(me, "cf_agent_identity")
    assert identity["agent"] == TOOL_AGENT
    [request] = sent(me, "cf_agent_use_chat_request")
    assert '"clientTools"' in request["init"]["body"], "the transport's body option carries clientTools"

    first, second, part = result["first"], result["second"], result["toolPart"]
    assert first["errors"] == [] and "tool-output-available" not in first["chunkTypes"]
    assert part["type"] == "tool-get_location" and part["state"] == "input-available"
    [tool_result] = sent(me, "cf_agent_tool_result")
    assert tool_result["toolCallId"] == part["toolCallId"] and tool_result["autoContinue"] is True

    continuation_id = result["continuationId"]
    assert continuation_id != result["requestId"]
    assert_continuation_handshake(me, result)
    continuation = frames(me, "cf_agent_use_chat_response", id=continuation_id)
    # The ACK's replay is the whole message, under its id (the client resets and rebuilds it, so it
    # shows it once, in place); the live tail that follows extends it (continuation: true).
    replayed = [f for f in continuation if f.get("replay") and isinstance(f["body"], dict)]
    assert replayed[0]["body"]["type"] == "start"
    assert replayed[0]["body"]["messageId"] == result["updated"]["id"]
    assert not any(f.get("continuation") for f in continuation if f.get("replay"))
    assert all(f.get("continuation") for f in continuation if not f.get("replay"))
    assert continuation[-1]["done"] is True and continuation[-1]["outcome"] == "completed"

    [updated_part] = [p for p in result["updated"]["parts"] if p.get("toolCallId") == part["toolCallId"]]
    assert updated_part["state"] == "output-available" and updated_part["output"] == output
    assert second["errors"] == []
    expected = f'Tool get_location returned: {{"city": "Lisbon", "nonce": "{output["nonce"]}"}}'
    assert second["text"] == expected

    transcript = get_messages(stack.port, TOOL_AGENT, name)
    # The continuation extended the message that made the call (continuation: true says so).
    assert [m["role"] for m in transcript] == ["user", "assistant"]
    assert transcript[1]["id"] == result["updated"]["id"]
    [stored] = [p for p in transcript[1]["parts"] if p.get("toolCallId") == part["toolCallId"]]
    assert stored["state"] == "output-available" and stored["output"] == output
    assert message_text(transcript[1]) == expected
    assert result["broadcast"] == transcript, "the transcript sent after the done frame is the store"
    # The continuation's own start names no message: the client appends it to the one it continues.
    stored_start = Segment.objects.filter(stream__request_id=continuation_id, seq_start=0).first()
    assert stored_start is not None and stored_start.body.split("\n")[0] == '{"type":"start"}'
    fiber = Fiber.objects.get(request_id=continuation_id)
    assert fiber.kind == TurnKind.CONTINUE and fiber.status == Fiber.Status.COMPLETED


@pytest.fixture(scope="module")
def approval_run(stack: Any, node: str) -> Iterator[dict[str, Any]]:
    """One approval round trip, shared by the tests of the server's side and of the client's fold."""
    tag = f"js-{uuid.uuid4().hex[:8]}"
    name = new_name("approval")
    # Paced, so the continuation still runs when the hook ACKs it: that is the path tested here (one
    # that ended first is answered as finished, tests/chat/wire/test_resume.py).
    prompt = f'[tool delete_file {{"tag": "{tag}"}}] [rate 20]'
    result = run_scenario(node, stack.port, TOOL_AGENT, name, "approval", prompt=prompt)
    yield {
        "tag": tag,
        "result": result,
        "transcript": get_messages(stack.port, TOOL_AGENT, name),
        "runs": tool_runs(tag),
    }


def test_a_tool_approval_round_trip(approval_run: dict[str, Any]) -> None:
    tag, result, transcript = approval_run["tag"], approval_run["result"], approval_run["transcript"]
    me = tab(result)
    first, part = result["first"], result["toolPart"]
    assert first["errors"] == []
    assert first["chunkTypes"][-4:] == [
        "tool-input-available",
        "tool-approval-request",
        "finish-step",
        "finish",
    ]
    assert part["type"] == "tool-delete_file" and part["state"] == "approval-requested"
    assert part["input"] == {"tag": tag} and part["approval"]["id"]

    # The approval is found by approval.id, as addToolApprovalResponse does, and answered by toolCallId.
    [approval] = sent(me, "cf_agent_tool_approval")
    assert approval == {**approval, "toolCallId": part["toolCallId"], "approved": True, "autoContinue": True}
    [updated_part] = [p for p in result["updated"]["parts"] if p.get("toolCallId") == part["toolCallId"]]
    assert updated_part["state"] == "approval-responded"
    assert updated_part["approval"] == {"id": part["approval"]["id"], "approved": True}

    assert_continuation_handshake(me, result)
    continuation = frames(me, "cf_agent_use_chat_response", id=result["continuationId"])
    assert all(f.get("continuation") for f in continuation)
    chunks = [f["body"] for f in continuation if isinstance(f["body"], dict)]
    output = {"type": "tool-output-available", "toolCallId": part["toolCallId"], "output": f"deleted {tag}"}
    assert output in chunks, "the approved call's output is part of the continuation stream"
    assert frames_text(continuation) == f"Tool delete_file returned: deleted {tag}"
    assert continuation[-1]["done"] is True and continuation[-1]["outcome"] == "completed"

    assert approval_run["runs"] == 1, "the approved tool ran once"
    assert [m["role"] for m in transcript] == ["user", "assistant"], "the continuation extended it"
    [stored] = [p for p in transcript[1]["parts"] if p.get("toolCallId") == part["toolCallId"]]
    assert stored["state"] == "output-available" and stored["output"] == f"deleted {tag}"
    assert message_text(transcript[1]) == f"Tool delete_file returned: deleted {tag}"
    assert result["broadcast"] == transcript, "the transcript sent after the done frame is the store"


def test_the_approval_continuation_folds_onto_the_approved_call(approval_run: dict[str, Any]) -> None:
    tag, result = approval_run["tag"], approval_run["result"]
    second, part = result["second"], result["toolPart"]
    assert second["errors"] == []
    [folded_part] = [p for p in second["message"]["parts"] if p.get("toolCallId") == part["toolCallId"]]
    assert folded_part["state"] == "output-available" and folded_part["output"] == f"deleted {tag}"
    assert second["text"] == f"Tool delete_file returned: deleted {tag}"


def test_a_second_tab_observes_the_turn(stack: Any, node: str) -> None:
    name = new_name("tabs")
    result = run_scenario(node, stack.port, "assistant", name, "secondTab", prompt="count to 25 [rate 100]")
    request_id = result["requestId"]
    tab1, tab2 = tab(result, "tab1"), tab(result, "tab2")
    assert tab1["id"] != tab2["id"]

    # The user message reaches the other tab before any frame of the turn.
    pushed = result["pushed"]
    assert [(m["id"], m["role"]) for m in pushed["messages"]] == [(result["userId"], "user")]
    observed = frames(tab2, "cf_agent_use_chat_response", id=request_id)
    assert pushed["t"] <= observed[0]["t"]
    echoed = [f for f in frames(tab1, "cf_agent_chat_messages") if f["messages"] == pushed["messages"]]
    assert echoed == [], "the sender is not echoed its own message"

    # Every live frame, and nothing replayed: the same frames, in the same order, as the sender's.
    own = frames(tab1, "cf_agent_use_chat_response", id=request_id)
    strip = ("t", "gen")
    assert [{k: v for k, v in f.items() if k not in strip} for f in observed] == [
        {k: v for k, v in f.items() if k not in strip} for f in own
    ]
    assert not any(f.get("replay") for f in observed)
    assert chunk_seqs(observed) == list(range(len(observed) - 1))
    assert tab2["sent"] == [], "observing needs no request, probe or ACK"

    assert result["observed"]["errors"] == [] and result["own"]["errors"] == []
    assert result["observed"]["text"] == result["own"]["text"] == numbers(25)
    assert result["observed"]["message"]["id"] == result["own"]["message"]["id"]


def test_a_probe_racing_the_stream_open_is_not_answered_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race of the tool-continuation probe, made deterministic: the worker opens the stream (in its
    own connection) right after the probe looked for an active stream."""
    import threading

    from django.db import connection

    import chat.wire.resume as resume
    from chat.models import Conversation
    from recovery.models import Stream

    conversation = Conversation.objects.create(agent="assistant", name=new_name("race"), owner=TEST_PRINCIPAL)
    fiber = Fiber.objects.create(
        conversation=conversation, request_id="cont-1", status=Fiber.Status.RUNNING, fencing=1
    )

    def worker_opens_the_stream() -> None:
        try:
            Stream.objects.create(
                conversation=conversation, fiber=fiber, request_id="cont-1", message_id="m-1"
            )
        finally:
            connection.close()

    real_active_stream = resume.active_stream

    def active_stream_then_the_worker(**kwargs: Any) -> Any:
        found = real_active_stream(**kwargs)
        worker = threading.Thread(target=worker_opens_the_stream)
        worker.start()
        worker.join(10)
        return found

    monkeypatch.setattr(resume, "active_stream", active_stream_then_the_worker)
    answer = resume.probe_answer(conversation_id=conversation.pk)
    assert answer.kind in ("resuming", "pending"), f"a running turn was answered {answer.kind!r}"
