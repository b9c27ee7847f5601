"""moe_replay: record and replay what a Mixture-of-Experts model did during RL rollouts."""
__version__ = "0.1.0"
