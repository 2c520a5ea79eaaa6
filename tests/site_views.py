"""A site's own view that runs a turn and answers with its stream, exactly as the README shows it
(tests/e2e/test_http_wire.py checks both: the README's block is this function's source)."""

from asgiref.sync import sync_to_async
from django.contrib.auth.decorators import login_required

from chat.access import user_principal
from chat.agents import open_agent
from chat.wire.http import turn_response


@login_required
async def summarise(request, ticket):
    user = await request.auser()
    handle = await sync_to_async(open_agent)("assistant", f"ticket-{ticket}", owner=user_principal(user))
    started = await sync_to_async(handle.save_messages)([f"Summarise ticket {ticket}"], wait=False)
    return turn_response(handle.conversation_id, started.request_id)
