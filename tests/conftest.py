"""Hypothesis profiles: ``dev`` (fast, the default) and ``ci`` (more examples).

``CI`` set in the environment selects ``ci``; ``HYPOTHESIS_PROFILE`` names a
profile explicitly.  The state machines in ``test_stateful.py`` run
``max_examples`` programs each, so ``ci`` runs 4 x 500 = 2,000 programs of
up to ``stateful_step_count`` steps.
"""

import os

from hypothesis import settings

# No deadline: one example's time depends on the pool sizes it draws, and a
# deadline failure on a loaded CI machine would be noise, not a finding.
settings.register_profile("dev", max_examples=30, stateful_step_count=20, deadline=None)
settings.register_profile("ci", max_examples=500, stateful_step_count=25, deadline=None,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
