"""A rank's process group across generations: membership, its sockets, replica checks."""
