"""A target whose unconditional import is not installed."""

import remedy_no_such_package_xyz


def main() -> None:
    """Never reached."""
    remedy_no_such_package_xyz.train()
