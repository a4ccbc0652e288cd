"""A target whose `main` is not a function."""

main = 42
