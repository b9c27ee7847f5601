"""Capture: routed experts, exact sampling support and sampled logprobs per request (api.py). Importing
it registers its endpoint ops (`capture.*`, worker.py) and load-time step (route_hook.py) with the base."""

from . import preemption, worker  # noqa: F401  (registrations)
