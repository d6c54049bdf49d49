"""The I/O shell: moves bytes between clients and the upstream and reports edges to the lifecycle core."""
