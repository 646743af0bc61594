"""The durable, ordered log of applied graph updates and its replay at start."""
