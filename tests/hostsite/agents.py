"""The host site's agent."""

from chat.agents import Think


class Helpdesk(Think):
    def get_system_prompt(self) -> str:
        return "You answer questions about the host site."
