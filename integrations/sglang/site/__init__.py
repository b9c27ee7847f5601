"""The folder a scoring engine puts on its processes' PYTHONPATH (`scoring.SITE_DIR`): its sitecustomize.py loads
moe_replay's force hook (force.py) in each SGLang process at start-up. Nothing here is imported by moe_replay."""
