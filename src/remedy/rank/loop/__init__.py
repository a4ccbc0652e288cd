"""The training loop's arithmetic and measurements: one step, its numbers, telemetry, logs."""
