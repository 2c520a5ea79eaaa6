"""Process plumbing: one event loop per worker process and its database threads (runtime), rows inserted as
the ORM would (rows), the broker transport, and the public faces' lazy names."""
