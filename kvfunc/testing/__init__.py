"""Model-based testing kit for kvfunc (and for engines built on it).

Three pieces, usable from kvfunc's own tests and from an integrator's:

* :class:`NaiveAllocator`: a deliberately simple mutable model of the
  allocator, written straight from the spec (refusals made atomic, as kvfunc
  makes them);
* Hypothesis strategies: :func:`policies`, :func:`group_configs`,
  :func:`kv_states` (either layout: :func:`layouts`,
  :func:`shared_sizes`), :func:`slot_requests`, :func:`programs` (tuples of
  :class:`Allocate`, :class:`Batch`, :class:`Free`, :class:`Recycle`);
* :class:`KVStateMachine`: a ``RuleBasedStateMachine`` that drives the pure
  core and the model side by side; run it with ``KVStateMachine.TestCase``
  or :func:`run_state_machine`.

Needs ``hypothesis`` (the ``dev`` extra); ``import kvfunc`` never imports this.

The model and the core agree on a program:

>>> import kvfunc as kf
>>> from kvfunc.testing import Allocate, NaiveAllocator, apply_to_model, run_program
>>> groups = {"full": kf.FullAttention(num_blocks=5, block_size=4)}
>>> program = [Allocate(kf.SlotRequest("a", 0, 9)), Allocate(kf.SlotRequest("b", 0, 9))]
>>> steps = run_program(kf.KVState.create(groups, 64), program)
>>> model = NaiveAllocator(groups, 64)
>>> [apply_to_model(model, op) for op in program] == [s.refused for s in steps]
True
>>> kf.get_block_ids(steps[-1].after, "a") == model.get_block_ids("a") == {"full": (1, 2, 3)}
True

An engine reuses the machine with its own groups and checks its own layer
after every accepted transition; ``EngineMachine.TestCase`` is a test class
that pytest collects:

>>> from hypothesis import strategies as st
>>> from kvfunc.testing import KVStateMachine, run_state_machine
>>> class EngineMachine(KVStateMachine):
...     groups_strategy = st.just({"FullAttention": kf.FullAttention(64, 16),
...                                "SlidingWindow": kf.SlidingWindow(32, 16, 128)})
...     max_tokens = 512
...
...     def after_transition(self, before, after, delta):
...         # Where a shell would zero the blocks a delta hands out, say.
...         for key in after.manager_keys:
...             held = {b for table in after.group(key).tables.values() for b in table}
...             assert set(delta.new_block_ids(key)) <= held
>>> run_state_machine(EngineMachine, max_examples=5, stateful_step_count=10)
"""

from kvfunc.testing._machine import (
    KVStateMachine,
    run_state_machine,
    state_snapshot,
    token_budget,
)
from kvfunc.testing._model import NaiveAllocator, apply_to_model
from kvfunc.testing._strategies import (
    Allocate,
    Batch,
    Free,
    Operation,
    Recycle,
    Step,
    apply_operation,
    group_configs,
    kv_states,
    layouts,
    make_slot_request,
    manager_key_selections,
    max_model_lens,
    policies,
    programs,
    request_fields,
    run_program,
    shared_sizes,
    slot_requests,
)
from kvfunc.testing._tier_machine import TieredStateMachine
from kvfunc.testing._tier_model import NaiveTiers

__all__ = [
    "Allocate",
    "Batch",
    "Free",
    "KVStateMachine",
    "NaiveAllocator",
    "NaiveTiers",
    "Operation",
    "Recycle",
    "Step",
    "TieredStateMachine",
    "apply_operation",
    "apply_to_model",
    "group_configs",
    "kv_states",
    "layouts",
    "make_slot_request",
    "manager_key_selections",
    "max_model_lens",
    "policies",
    "programs",
    "request_fields",
    "run_program",
    "run_state_machine",
    "shared_sizes",
    "slot_requests",
    "state_snapshot",
    "token_budget",
]
