"""Run the next sitecustomize.py on the path after a given folder's (shared by the test beds).

Python loads only the first sitecustomize.py on the path; a test's subprocess may carry two beds
(tests/cpu_shims, tests/mrv2_bed), each with its own: each runs this after its own work, so the
next one found after its folder runs too."""

import importlib.util
import os
import sys


def run_next_sitecustomize(own_file: str) -> None:
    here = os.path.dirname(os.path.abspath(own_file))
    dirs = [os.path.abspath(p or os.curdir) for p in sys.path]
    if here not in dirs:
        return
    for folder in dirs[dirs.index(here) + 1:]:
        path = os.path.join(folder, "sitecustomize.py")
        if os.path.isfile(path) and os.path.abspath(path) != os.path.abspath(own_file):
            spec = importlib.util.spec_from_file_location(f"sitecustomize_{abs(hash(folder))}", path)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return
