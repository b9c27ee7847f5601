"""moe_replay ray adapter."""
