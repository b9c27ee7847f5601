"""moe_replay megatron adapter."""
