"""Operating recovery: the operators' actions, retention, metrics, traces, diagnostics events, faults and
the health endpoint."""
