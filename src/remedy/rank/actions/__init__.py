"""In-process actions: what a rank changes about how it trains when a command reaches it."""
