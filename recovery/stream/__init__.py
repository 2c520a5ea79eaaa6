"""The stream buffer: chunks buffered under a policy and stored as segments (buffer), the group commit of
every buffer of a worker (flusher), and the one JSON encoding of what streams (encoding)."""
