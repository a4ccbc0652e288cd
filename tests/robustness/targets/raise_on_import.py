"""A target that raises while its module is imported (in the rank)."""

raise ImportError("this module refuses to load: CUDA toolkit 99 required")


def main() -> None:
    """Never reached."""
