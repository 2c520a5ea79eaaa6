"""The transcript: reads and writes of conversations and messages, the chunk accumulator, repair,
compaction, client interactions and durable submissions."""
