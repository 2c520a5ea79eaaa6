"""The scripted model's bound on what one message makes it build (issue 34, row 7).

A reply is built whole before it is sent, so `count to 1000000000 [rate 0]` would have the demo's model
build a billion strings: one message knocked over the compose stack. N above SCRIPTED_MODEL_MAX_CHUNKS
is refused with a clear 400, over HTTP, and the server answers the next request as before.
"""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import json  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import aiohttp  # noqa: E402
import pytest  # noqa: E402

from think_scripted import server as scripted  # noqa: E402
from think_scripted.server import ScriptedModelServer  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedModelServer]:
    with ScriptedModelServer(token_rate=0) as srv:
        yield srv


async def post(server: ScriptedModelServer, text: str) -> tuple[int, str]:
    body = {"model": "scripted", "stream": True, "messages": [{"role": "user", "content": text}]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        async with session.post(f"{server.url}/chat/completions", data=json.dumps(body)) as response:
            return response.status, await response.text()


def test_the_default_bound() -> None:
    assert scripted.MAX_CHUNKS == 20_000


@pytest.mark.parametrize("text", ["count to 1000000000 [rate 0]", "count to 20001", "count to " + "9" * 5000])
async def test_a_count_past_the_bound_is_refused_and_the_server_still_answers(
    server: ScriptedModelServer, text: str
) -> None:
    status, body = await post(server, text)
    assert status == 400, body[:200]
    error = json.loads(body)["error"]
    assert "at most 20000 numbers" in error["message"], error
    assert error["type"] == "invalid_request_error"

    status, body = await post(server, "count to 3")
    assert status == 200
    assert '"content": " 3"' in body or '"content":" 3"' in body


async def test_a_count_at_the_bound_is_served(server: ScriptedModelServer) -> None:
    status, body = await post(server, "count to 20000 [rate 0]")
    assert status == 200
    assert " 20000" in body


async def test_other_numbers_too_long_to_read_are_a_400(server: ScriptedModelServer) -> None:
    status, body = await post(server, "count to 2 [stall after " + "9" * 5000 + "]")
    assert status == 400, body[:200]
    assert "cannot be read" in json.loads(body)["error"]["message"]
