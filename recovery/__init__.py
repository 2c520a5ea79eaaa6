"""Durable turns: fibers and leases, resumable stream buffers, incidents, alarms and the recovery engine."""
