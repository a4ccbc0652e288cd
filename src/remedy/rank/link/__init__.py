"""A rank's link to its supervisor: reports out, commands in, liveness, forwarded output."""
