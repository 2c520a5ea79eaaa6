"""The wire: the cf_agent_* codec, the WebSocket consumer, replay and resume, fan-out to the
web processes, input limits and origin checks."""
