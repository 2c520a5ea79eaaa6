"""The recovery budget: incidents and what they allow (max attempts, no-progress and work and cost
bounds, debounce), as pure functions of the stored incident with an injected clock. Their rows are the
engine's (recovery.engine.store)."""
