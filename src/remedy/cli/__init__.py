"""The `remedy` command line: the driver of `remedy run` and the commands that find a run."""
