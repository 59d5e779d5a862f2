"""The torch shell: turns the pure core's states and deltas into tensors."""
