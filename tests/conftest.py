"""Suite-wide pytest setup: hypothesis profiles.

HYPOTHESIS_PROFILE picks one: `default` (random examples) for development, `ci` (derandomized, so a
CI failure reproduces exactly; the default when $CI is set). Neither has a deadline: the first trace
of a model pays torch's warm-up. For a longer search, scale the example counts of tests/ir with
FNPIPE_EXAMPLES=10 (see tests/ir/ir_cases.py).
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("default", **_COMMON)
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))

pytest_plugins = ["engine.testing.pytest_plugin"]
