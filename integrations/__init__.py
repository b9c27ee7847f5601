"""Framework adapters; each imports its framework lazily."""
