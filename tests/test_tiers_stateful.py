"""The tiers against the naive tier model: random programs of admissions, steps and moves."""

from __future__ import annotations

from hypothesis import settings

from kvfunc.testing import TieredStateMachine

TieredStateMachine.TestCase.settings = settings(settings.default, stateful_step_count=50)
TestTiers = TieredStateMachine.TestCase
