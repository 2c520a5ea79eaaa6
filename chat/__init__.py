"""Conversations, UIMessage transcripts, the agent API and the WebSocket surface."""
