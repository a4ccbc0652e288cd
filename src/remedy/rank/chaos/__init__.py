"""Fault injection for chaos tests: faults scheduled by step and rank, and their record."""
