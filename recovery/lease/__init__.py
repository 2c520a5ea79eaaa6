"""Fibers under leases: claims, heartbeats, fencing and every state change of a fiber; a dead worker
noticed by its lost session (liveness); a cancel that reaches the worker at once (control)."""
