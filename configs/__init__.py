"""Shipped YAML presets (installed as `moe_replay.configs`); load with `moe_replay.presets.load_preset`."""
