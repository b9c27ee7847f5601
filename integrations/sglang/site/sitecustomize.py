"""Loads moe_replay's force hook in every process of an SGLang scoring engine (integrations/sglang/force.py).

Put this folder on the engine's PYTHONPATH (`moe_replay.integrations.sglang.scoring.SITE_DIR`): Python imports
sitecustomize at start-up in each process, SGLang's scheduler included, before any model is built. Inert in
processes that never import SGLang's modules. An environment with its own sitecustomize calls
`moe_replay.integrations.sglang.force.install_on_import()` from it instead.
"""

from moe_replay.integrations.sglang.force import install_on_import

install_on_import()
