"""What the daemon does with its parts: removals and pruning, and the parts handed to the API."""
