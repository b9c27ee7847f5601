"""moe_replay vllm adapter."""
