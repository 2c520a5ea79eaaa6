"""The AI SDK's HTTP chat wire (chat.wire.http), read raw with httpx on the real stack: the SSE framing,
the answer across a dead worker, the rejoin, a resent POST, the stop, and every refusal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async

from chat.models import Message
from recovery.models import Fiber
from tests.support import (
    ChatClient,
    access_token,
    assistant_text,
    chat_request,
    follow_conversation,
    numbers,
    start_daphne,
    user_message,
)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

AGENT = "assistant"


def new_name() -> str:
    return f"h-{uuid.uuid4().hex[:10]}"


def bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {access_token()}"}


def body(name: str, text: str, message_id: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": name, "messages": [user_message(text, message_id)], "trigger": "submit-message", **extra}


class Answer:
    """One SSE response, as the AI SDK reads it: the chunks, and whether `[DONE]` ended it."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.done = False
        self.pings = 0
        self.headers: httpx.Headers | None = None
        self.status = 0
        self.lines: Any = None

    @property
    def text(self) -> str:
        return "".join(c.get("delta", "") for c in self.chunks if c["type"] == "text-delta")

    @property
    def types(self) -> list[str]:
        return [c["type"] for c in self.chunks]

    async def read(self, response: httpx.Response, *, until: Any = None) -> Answer:
        """Read on (where an earlier read of this response stopped) to its end, or until `until`."""
        self.status, self.headers = response.status_code, response.headers
        if self.lines is None:
            self.lines = response.aiter_lines()
        async for line in self.lines:
            if line.startswith(": "):
                self.pings += 1
                if until is not None and until(self):
                    return self
            if not line.startswith("data: "):
                continue
            assert not self.done, "nothing may follow [DONE]"
            data = line[len("data: ") :]
            if data == "[DONE]":
                self.done = True
                continue
            self.chunks.append(json.loads(data))
            if until is not None and until(self):
                return self
        return self


async def post(client: httpx.AsyncClient, port: int, payload: Any, *, until: Any = None) -> Answer:
    url = f"http://127.0.0.1:{port}/ai/{AGENT}"
    async with client.stream("POST", url, json=payload, headers=bearer()) as response:
        if response.status_code != 200:
            answer = Answer()
            answer.status = response.status_code
            answer.chunks = [{"type": "refusal", "text": (await response.aread()).decode()}]
            return answer
        return await Answer().read(response, until=until)


async def rejoin(client: httpx.AsyncClient, port: int, name: str, *, until: Any = None) -> Answer:
    url = f"http://127.0.0.1:{port}/ai/{AGENT}/{name}/stream"
    async with client.stream("GET", url, headers=bearer()) as response:
        if response.status_code != 200:
            answer = Answer()
            answer.status = response.status_code
            return answer
        return await Answer().read(response, until=until)


def words(at_least: int) -> Any:
    return lambda answer: len(answer.text.split()) >= at_least


def stored(name: str) -> list[dict[str, Any]]:
    from chat.transcript.selectors import conversation_get, messages_list

    conversation = conversation_get(agent=AGENT, name=name)
    assert conversation is not None
    return messages_list(conversation_id=conversation.pk)


def assert_one_message(answer: Answer, name: str) -> None:
    """One `start` naming the stored answer, then its chunks; the stored text is the streamed text."""
    assert answer.types.count("start") == 1 and answer.types[0] == "start", answer.types[:5]
    transcript = stored(name)
    assert answer.chunks[0]["messageId"] == transcript[-1]["id"]
    assert assistant_text(transcript) == answer.text


async def test_a_post_answers_with_the_ai_sdk_event_stream(stack: Any) -> None:
    name = new_name()
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await post(client, stack.port, body(name, "count to 30"))
    assert answer.status == 200
    assert answer.headers is not None
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.headers["cache-control"] == "no-cache"
    assert answer.headers["x-vercel-ai-ui-message-stream"] == "v1"
    assert answer.headers["x-accel-buffering"] == "no"
    assert answer.text == numbers(30)
    assert answer.types[-1] == "finish" and answer.done
    assert {"start-step", "text-start", "text-end", "finish-step"} <= set(answer.types)
    await sync_to_async(assert_one_message)(answer, name)


async def test_a_worker_killed_mid_answer_does_not_end_the_response(recovery_stack: Any) -> None:
    """The only worker is SIGKILLed mid-answer and another started: the same response carries on into
    the recovery's continuation, in the same message, 1..60 once, then finish and [DONE]."""
    worker = recovery_stack.start_worker()
    name = new_name()
    try:
        async with httpx.AsyncClient(timeout=90) as client:
            url = f"http://127.0.0.1:{recovery_stack.port}/ai/{AGENT}"
            payload = body(name, "count to 60 [rate 25]")
            async with client.stream("POST", url, json=payload, headers=bearer()) as response:
                answer = Answer()
                await answer.read(response, until=words(12))
                worker.kill(signal.SIGKILL)
                await asyncio.to_thread(recovery_stack.start_worker)
                await answer.read(response)
    finally:
        recovery_stack.stop_workers()
    assert answer.text == numbers(60)
    assert answer.done and answer.types[-1] == "finish"
    await sync_to_async(assert_one_message)(answer, name)
    chain = [f.request_id async for f in Fiber.objects.filter(conversation__name=name)]
    assert len(chain) == 2, "the answer was continued by a recovery"


async def test_a_rejoin_replays_the_answer_from_its_start_then_follows_it(stack: Any) -> None:
    name = new_name()
    async with httpx.AsyncClient(timeout=60) as client:
        assert (await rejoin(client, stack.port, name)).status == 204, "no conversation: nothing to rejoin"
        first = asyncio.create_task(
            post(client, stack.port, body(name, "count to 40 [rate 40]"), until=words(10))
        )
        await first
        joined = await rejoin(client, stack.port, name)
        assert (await rejoin(client, stack.port, name)).status == 204, "the turn has ended"
    assert joined.text == numbers(40) and joined.done
    await sync_to_async(assert_one_message)(joined, name)


async def test_the_same_post_twice_at_once_starts_one_turn(stack: Any) -> None:
    name = new_name()
    payload = body(name, "count to 20", message_id=f"u-{uuid.uuid4().hex[:8]}")
    async with httpx.AsyncClient(timeout=60) as client:
        one, two = await asyncio.gather(post(client, stack.port, payload), post(client, stack.port, payload))
        again = await post(client, stack.port, payload)  # after the end: the finished answer, replayed
    assert one.text == two.text == again.text == numbers(20)
    assert one.chunks[0]["messageId"] == two.chunks[0]["messageId"] == again.chunks[0]["messageId"]
    assert await Fiber.objects.filter(conversation__name=name).acount() == 1
    assert await Message.objects.filter(conversation__name=name).acount() == 2


async def test_stop_ends_the_turn_and_the_answer_with_what_was_stored(stack: Any) -> None:
    name = new_name()
    async with httpx.AsyncClient(timeout=60) as client:
        url = f"http://127.0.0.1:{stack.port}/ai/{AGENT}"
        async with client.stream(
            "POST", url, json=body(name, "count to 300 [rate 40]"), headers=bearer()
        ) as r:
            answer = await Answer().read(r, until=words(8))
            stopped = await client.post(f"{url}/{name}/stop", headers=bearer())
            assert stopped.status_code == 200 and stopped.json()["stopped"] is True
            await answer.read(r)
        after = await post(client, stack.port, body(name, "count to 3"))
    assert answer.done and answer.types[-1] == "abort"
    transcript = await sync_to_async(stored)(name)
    assert transcript[1]["role"] == "assistant"
    kept = "".join(p.get("text", "") for p in transcript[1]["parts"] if p["type"] == "text")
    assert kept == answer.text and answer.text.startswith(numbers(8))
    assert after.text == numbers(3) and after.done


async def test_a_turn_sent_over_the_websocket_is_rejoined_over_http(stack: Any) -> None:
    name = new_name()
    async with ChatClient(stack.port, name) as ws, httpx.AsyncClient(timeout=60) as client:
        await ws.send(chat_request("ws-1", [user_message("count to 40 [rate 40]")]))
        await follow_conversation(ws, until=lambda log: len(log.stream("ws-1").chunks) >= 8, timeout=30)
        joined = await rejoin(client, stack.port, name)
    assert joined.text == numbers(40) and joined.done
    await sync_to_async(assert_one_message)(joined, name)


async def test_refusals_are_clear_and_store_nothing(stack: Any) -> None:
    name = new_name()
    url = f"http://127.0.0.1:{stack.port}/ai/{AGENT}"
    payload = body(name, "count to 3")
    async with httpx.AsyncClient(timeout=30) as client:
        anonymous = await client.post(url, json=payload)
        bad_token = await client.post(url, json=payload, headers={"Authorization": "Bearer nope"})
        unknown = await client.post(
            f"http://127.0.0.1:{stack.port}/ai/no-such-agent", json=payload, headers=bearer()
        )
        not_json = await client.post(
            url, content=b"{", headers={**bearer(), "content-type": "application/json"}
        )
        no_id = await client.post(url, json={"messages": []}, headers=bearer())
        bad_trigger = await client.post(url, json={**payload, "trigger": "resume"}, headers=bearer())
        huge = await client.post(url, content=b"x" * 1_000_001, headers=bearer())
        get_send = await client.get(url, headers=bearer())
        stop_anon = await client.post(f"{url}/{name}/stop")
        rejoin_anon = await client.get(f"{url}/{name}/stream")
    assert (anonymous.status_code, bad_token.status_code) == (403, 403)
    assert unknown.status_code == 404 and "no-such-agent" in unknown.text
    assert not_json.status_code == 400 and "not JSON" in not_json.text
    assert no_id.status_code == 400 and "'id'" in no_id.text
    assert bad_trigger.status_code == 400 and "trigger" in bad_trigger.text
    assert huge.status_code == 413
    assert get_send.status_code == 405
    assert (stop_anon.status_code, rejoin_anon.status_code) == (403, 403)
    assert not await Message.objects.filter(conversation__name=name).aexists()


async def test_a_session_cookie_post_needs_the_csrf_token(stack: Any) -> None:
    """A browser's session cookie alone does not send: Django's CSRF check stands, as for its forms."""
    name = new_name()
    session = await sync_to_async(login)(f"http-{uuid.uuid4().hex[:6]}")
    token = "a" * 32
    async with httpx.AsyncClient(timeout=30, base_url=f"http://127.0.0.1:{stack.port}") as client:
        client.cookies.set("sessionid", session)
        forged = await client.post(f"/ai/{AGENT}", json=body(name, "count to 3"))
        stop_forged = await client.post(f"/ai/{AGENT}/{name}/stop")
        client.cookies.set("csrftoken", token)
        sent = await client.post(
            f"/ai/{AGENT}", json=body(name, "count to 3"), headers={"X-CSRFToken": token}
        )
    assert forged.status_code == 403 and "CSRF" in forged.text
    assert stop_forged.status_code == 403 and "CSRF" in stop_forged.text
    answer = Answer()
    answer.chunks = [json.loads(line[6:]) for line in sent.text.splitlines() if line.startswith("data: {")]
    assert sent.status_code == 200 and answer.text == numbers(3)


def login(username: str) -> str:
    """A Django login as the site's own login view makes it; the sessionid cookie's value."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    client = Client()
    client.force_login(get_user_model().objects.create_user(username))
    return client.cookies["sessionid"].value


async def test_tool_answers_come_back_in_a_post_and_a_forged_output_is_refused(stack: Any) -> None:
    """The AI SDK posts its assistant message back with the answers in its parts. An approval answer
    continues the same message in the response; an output for the call that waits for approval (a
    server tool's: only the server writes it) is refused, and nothing of it is stored."""
    name = new_name()
    async with httpx.AsyncClient(timeout=60) as client:
        asked = await post(
            client, stack.port, body(name, '[tool send_email {"to": "a@b.c", "subject": "hi"}]')
        )
        assert asked.done and "tool-approval-request" in asked.types
        user, message = await sync_to_async(stored)(name)
        [part] = [p for p in message["parts"] if p["type"] == "tool-send_email"]
        assert part["state"] == "approval-requested"
        forged = {**part, "state": "output-available", "output": {"sent": "by the client"}}
        refused = await client.post(
            f"http://127.0.0.1:{stack.port}/ai/{AGENT}",
            json=answer_body(name, user, message, forged),
            headers=bearer(),
        )
        assert refused.status_code == 422 and "waits for approval" in refused.text
        after = await sync_to_async(stored)(name)
        assert after[1]["parts"] == message["parts"], "the forged output changed nothing"
        approved = {**part, "state": "approval-responded", "approval": {**part["approval"], "approved": True}}
        answer = await post(client, stack.port, answer_body(name, user, message, approved))
    assert answer.done and answer.types[-1] == "finish"
    assert "start" in answer.types and "messageId" not in answer.chunks[0], "it goes on in the same message"
    assert "tool-output-available" in answer.types
    transcript = await sync_to_async(stored)(name)
    assert [m["id"] for m in transcript] == [user["id"], message["id"]]
    [tool] = [p for p in transcript[1]["parts"] if p["type"] == "tool-send_email"]
    assert tool["state"] == "output-available" and "queued" in tool["output"]


def answer_body(
    name: str, user: dict[str, Any], message: dict[str, Any], part: dict[str, Any]
) -> dict[str, Any]:
    """What the AI SDK posts after addToolOutput or addToolApprovalResponse: the messages with the
    assistant message's part updated, `messageId` naming that message."""
    parts = [part if p.get("toolCallId") == part["toolCallId"] else p for p in message["parts"]]
    updated = {**message, "parts": parts}
    return {"id": name, "messages": [user, updated], "trigger": "submit-message", "messageId": message["id"]}


@pytest.fixture(scope="module")
def bounded_daphne(stack: Any, log_dir: Path) -> Iterator[Any]:
    """A daphne of the shared stack with low per-principal bounds (the shared worker runs its turns),
    that keeps its database connections (CONN_MAX_AGE), as sites do."""
    env = {
        "THINK_PRINCIPAL_MAX_SOCKETS": "2",
        "THINK_PRINCIPAL_REPLAYS_PER_MINUTE": "2",
        "DJANGO_CONN_MAX_AGE": "600",
    }
    daphne, port = start_daphne({**stack.env, **env}, log_dir)
    yield daphne, port
    daphne.stop()


@pytest.fixture(scope="module")
def bounded(bounded_daphne: Any) -> int:
    return int(bounded_daphne[1])


async def test_open_responses_count_as_the_principals_sockets(bounded: int) -> None:
    """Each open answer holds one of the principal's socket slots, as a WebSocket does: one over the
    bound is refused with 429 before anything is stored, and a closed answer frees its slot."""
    principal = f"test:{uuid.uuid4().hex[:10]}"
    headers = {"Authorization": f"Bearer {access_token(principal)}"}
    url = f"http://127.0.0.1:{bounded}/ai/{AGENT}"
    names = [new_name() for _ in range(3)]
    reading = []  # (an answer's reader, dropped, would close its response)
    async with httpx.AsyncClient(timeout=60) as client, contextlib.AsyncExitStack() as held:
        for name in names[:2]:
            response = await held.enter_async_context(
                client.stream("POST", url, json=body(name, "count to 300 [rate 20]"), headers=headers)
            )
            reading.append(await Answer().read(response, until=words(1)))
        over = await client.post(url, json=body(names[2], "count to 3"), headers=headers)
        assert over.status_code == 429 and "connections open" in over.text, over.text
        async with ChatClient(bounded, names[2], principal=principal) as socket:
            assert await socket.close_code() == 4429
        assert not await Message.objects.filter(conversation__name=names[2]).aexists()
        await held.aclose()  # both answers closed by the client: their turns go on, their slots are freed
        answer = await post_as(client, url, body(names[2], "count to 3"), headers)
    assert answer.text == numbers(3) and answer.done


async def test_a_rejoin_beyond_the_principals_replays_is_refused(bounded: int) -> None:
    principal = f"test:{uuid.uuid4().hex[:10]}"
    headers = {"Authorization": f"Bearer {access_token(principal)}"}
    name = new_name()
    url = f"http://127.0.0.1:{bounded}/ai/{AGENT}"
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream(
            "POST", url, json=body(name, "count to 200 [rate 20]"), headers=headers
        ) as r:
            await Answer().read(r, until=words(1))
        statuses = []
        for _ in range(3):
            async with client.stream("GET", f"{url}/{name}/stream", headers=headers) as rejoined:
                statuses.append(rejoined.status_code)
                text = (await rejoined.aread()).decode() if rejoined.status_code != 200 else ""
        await client.post(f"{url}/{name}/stop", headers=headers)
    assert statuses == [200, 200, 429] and "replays" in text


async def post_as(client: httpx.AsyncClient, url: str, payload: Any, headers: dict[str, str]) -> Answer:
    async with client.stream("POST", url, json=payload, headers=headers) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        return await Answer().read(response)


async def test_the_readmes_view_streams_a_turn_it_starts(stack: Any) -> None:
    """A site's own view (README, "Front ends"): it starts a turn for the logged-in user and answers
    with its stream."""
    session = await sync_to_async(login)(f"site-{uuid.uuid4().hex[:6]}")
    ticket = str(uuid.uuid4().int % 10**9)
    async with httpx.AsyncClient(timeout=60, base_url=f"http://127.0.0.1:{stack.port}") as client:
        anonymous = await client.get(f"/tickets/{ticket}/summary")
        client.cookies.set("sessionid", session)
        async with client.stream("GET", f"/tickets/{ticket}/summary") as response:
            answer = await Answer().read(response)
    assert anonymous.status_code == 302, "the view's own access check stands"
    assert answer.status == 200 and answer.done and answer.types[-1] == "finish"
    transcript = await sync_to_async(stored)(f"ticket-{ticket}")
    assert transcript[0]["parts"][0]["text"] == f"Summarise ticket {ticket}"
    assert answer.text and assistant_text(transcript) == answer.text


def test_the_readme_shows_that_view_word_for_word() -> None:
    import inspect

    from tests.site_views import summarise

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert inspect.getsource(summarise) in readme


async def test_a_quiet_answer_is_kept_open_with_pings(stack: Any, log_dir: Path) -> None:
    """A model that stalls sends nothing for a while: the answer sends comment lines meanwhile (every
    HTTP_PING_S), and still ends as the turn does."""
    daphne, port = start_daphne({**stack.env, "THINK_TEST_HTTP_PING_S": "0.3"}, log_dir)
    name = new_name()
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            url = f"http://127.0.0.1:{port}/ai/{AGENT}"
            async with client.stream(
                "POST", url, json=body(name, "count to 50 [stall after 3]"), headers=bearer()
            ) as r:
                answer = await Answer().read(r, until=words(3))
                await answer.read(r, until=lambda a: a.pings >= 3)
                assert answer.text == numbers(3)
                await client.post(f"{url}/{name}/stop", headers=bearer())
                await answer.read(r)
    finally:
        daphne.stop()
    assert answer.done and answer.types[-1] == "abort"


async def test_a_turn_queued_behind_another_answers_only_its_own(stack: Any) -> None:
    """Two POSTs in one conversation: the second waits behind the first (the "queue" policy) and each
    answer carries its own turn only, the other's frames passing by."""
    name = new_name()
    async with httpx.AsyncClient(timeout=60) as client:
        first = asyncio.create_task(post(client, stack.port, body(name, "count to 60 [rate 40]")))
        await asyncio.sleep(0.3)
        second = await post(client, stack.port, body(name, "count to 3"))
        first_answer = await first
    assert first_answer.text == numbers(60) and first_answer.done
    assert second.text == numbers(3) and second.done
    transcript = await sync_to_async(stored)(name)
    assert [m["role"] for m in transcript] == ["user", "assistant", "user", "assistant"]
    assert second.chunks[0]["messageId"] == transcript[3]["id"]


def postgres_connections(pid: int) -> int:
    """The established TCP connections to port 5432 that process `pid` holds (from /proc)."""
    import os

    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
    found = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[2].endswith(":1538") and fields[3] == "01" and fields[9] in sockets:
                    found += 1
    return found


async def test_open_answers_do_not_hold_a_database_connection_each(bounded_daphne: Any) -> None:
    """An answer streams for as long as its turn runs; its database work runs on the process's shared
    pool, not on a thread of the request's own, so a site with CONN_MAX_AGE does not hold one Postgres
    connection per open answer (200 answers at once were refused by Postgres: too many clients)."""
    import os

    daphne, port = bounded_daphne
    pool = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor: the shared pool
    answers = pool + 6
    url = f"http://127.0.0.1:{port}/ai/{AGENT}"
    opened = []
    async with httpx.AsyncClient(timeout=60) as client:
        async with contextlib.AsyncExitStack() as held:
            for _ in range(answers):  # each its own principal: the socket bound is another test's
                headers = {"Authorization": f"Bearer {access_token(f'test:{uuid.uuid4().hex[:10]}')}"}
                name = new_name()
                response = await held.enter_async_context(
                    client.stream("POST", url, json=body(name, "count to 40 [rate 20]"), headers=headers)
                )
                assert response.status_code == 200
                opened.append((name, headers))
            held_now = postgres_connections(daphne.popen.pid)
        for name, headers in opened:  # the shared worker has other tests' turns to run
            await client.post(f"{url}/{name}/stop", headers=headers)
    assert held_now <= pool + 2, f"{answers} open answers hold {held_now} Postgres connections"
