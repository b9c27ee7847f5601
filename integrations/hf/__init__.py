"""moe_replay hf adapter."""
