"""The pure core against the naive model: ``kvfunc.testing.KVStateMachine``.

Each machine explores its own family of group configurations with the
profile's ``max_examples`` programs (see ``conftest.py``); the invariants
are those of :class:`~kvfunc.testing.KVStateMachine`.
"""

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import kvfunc as kf
from kvfunc.testing import KVStateMachine, group_configs, policies, run_state_machine


class FullAttentionMachine(KVStateMachine):
    """One or two full-attention groups: reservations and FIFO re-use."""

    groups_strategy = group_configs(max_groups=2, attn_types=["FullAttention"])


class SlidingWindowMachine(KVStateMachine):
    """Sliding windows, alone or next to full attention: null heads and recycling."""

    groups_strategy = group_configs(max_groups=2, attn_types=["SlidingWindow", "FullAttention"])


class MambaHybridMachine(KVStateMachine):
    """A Mamba state group next to full attention (Qwen3-Next / Jamba style)."""

    groups_strategy = st.builds(lambda full, mamba: {"FullAttention": full, "Mamba": mamba},
                                policies(attn_types=["FullAttention"]),
                                policies(attn_types=["Mamba"]))


TestAnyGroupsMatchModel = KVStateMachine.TestCase
TestFullAttentionMatchesModel = FullAttentionMachine.TestCase
TestSlidingWindowMatchesModel = SlidingWindowMachine.TestCase
TestMambaHybridMatchesModel = MambaHybridMachine.TestCase


def test_run_state_machine_runs_the_default_machine() -> None:
    """``run_state_machine`` runs ``KVStateMachine`` with explicit counts (the integrator path)."""
    run_state_machine(max_examples=5, stateful_step_count=5)


class _ForgetfulModelMachine(KVStateMachine):
    """A deliberately broken pairing: the model forgets every allocation."""

    def _allocate(self, req: kf.SlotRequest) -> None:
        super()._allocate(req)
        self.model.free(req.request_id)


def test_machine_catches_a_disagreeing_model() -> None:
    """The invariants fail when the model and the core diverge (they are not vacuous)."""
    quick = settings(max_examples=50, phases=[Phase.generate], database=None,
                     report_multiple_bugs=False, deadline=None)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(_ForgetfulModelMachine, settings=quick)
