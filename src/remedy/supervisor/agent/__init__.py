"""The node agent: one Ray actor per node between its ranks and the supervisor, and its pure core."""
