"""The chat app's Django signals.

    from django.dispatch import receiver
    from chat.signals import turn_completed

    @receiver(turn_completed)
    def answer_the_webhook(sender, *, result, **kwargs):
        slack.post(result.name, result.text)

`turn_completed` is sent once per turn, after the transaction that ended it committed, by the process
that ended it (or, when that process died first, by the recovery tick's sweep on another): `sender` is
the agent class (connect with `sender=MyAgent` to hear of one agent's turns only), `result` a
`chat.turn.deliveries.TurnCompleted`. Receivers run in a database thread
(the ORM works); what they raise is logged, never raised.
"""

from __future__ import annotations

from django.dispatch import Signal

turn_completed = Signal()
