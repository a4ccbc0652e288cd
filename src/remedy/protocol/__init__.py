"""What crosses a process boundary: commands and outcomes, report batches, phases, the run's spec."""
