"""A rank's training state: snapshots, durable checkpoints, sharding, data position, adoption."""
