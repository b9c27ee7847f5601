"""moe_replay: record and replay what a Mixture-of-Experts model did during RL rollouts.

    import moe_replay
    mr = moe_replay.enable("r3_support", llm=llm, model=model)   # see moe_replay.enablement
    moe_replay.audit(model, routes, token_ids, format="vllm").raise_if_misaligned()   # see moe_replay.audit

`import moe_replay` needs only torch, numpy and msgpack; adapters load their framework lazily.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("enable", "enable_async", "Enabled", "TrainBatch"):
        from . import enablement as _enable_module

        return getattr(_enable_module, name)
    if name == "audit":  # the package, callable as the function (moe_replay/audit/__init__.py)
        import importlib

        return importlib.import_module(f"{__name__}.audit")
    raise AttributeError(f"module 'moe_replay' has no attribute {name!r}")
