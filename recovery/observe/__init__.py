"""What every room reports: Prometheus metrics, OpenTelemetry spans, diagnostics events and the
beat's last tick."""
