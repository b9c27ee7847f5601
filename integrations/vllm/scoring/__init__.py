"""Scoring: re-score traces under their recorded routes and support (scorer.py). Importing it
registers its endpoint ops (`score.*`, force.py) and load-time step (force_step.py) with the base."""

from . import force  # noqa: F401  (registrations)
