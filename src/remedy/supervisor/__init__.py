"""remedy's Ray side: the supervisor actor, the worker group, the CLI."""
