"""The ``kvfunc`` command line and the library functions behind it.

``kvfunc plan`` sizes a model's caches for a memory budget, ``kvfunc
simulate`` replays a request trace through a continuous-batching scheduler
built on the pure allocator (with prefix caching on traces that name their
prompt blocks, a sweep of hit rate against capacity, and disaggregated
prefill and decode instances), and ``kvfunc replay`` verifies a recorded
delta log.  Everything the commands do is a
function here, so notebooks can call the same code::

    from kvfunc.cli import Budget, PlanConfig, build_preset, plan_model
    report = plan_model(build_preset("llama-3-8b"), PlanConfig(Budget(64 * 2**30)))
"""

from kvfunc.cli._args import SIMULATE_DEFAULTS, build_parser
from kvfunc.cli._custom import load_model_file, model_from_mapping
from kvfunc.cli._disagg import (
    DisaggConfig,
    DisaggResult,
    LatencyReport,
    Quantiles,
    SideReport,
    TransferReport,
)
from kvfunc.cli._disagg_run import run_disaggregated
from kvfunc.cli._errors import CLIError
from kvfunc.cli._layout import SIM_LAYOUTS, PoolUsage, default_layout
from kvfunc.cli._log import DeltaLogWriter, ReplayFailed, state_content, verify_log
from kvfunc.cli._main import main
from kvfunc.cli._mooncake import UpperBound, upper_bound
from kvfunc.cli._offload import OffloadConfig, TierReport
from kvfunc.cli._plan import (
    Budget,
    GroupPlan,
    PlanConfig,
    PlanReport,
    plan_model,
    size_blocks,
    size_shared_blocks,
)
from kvfunc.cli._plan_shared import SharedGroupPlan, SharedPlan
from kvfunc.cli._presets import PRESETS, ModelPreset, build_preset, preset_names
from kvfunc.cli._scheduler import Scheduler, SchedulerConfig
from kvfunc.cli._simulate import (
    PrefixReport,
    SimulationConfig,
    SimulationResult,
    build_state,
    run_simulation,
)
from kvfunc.cli._sweep import SweepPoint, SweepResult, run_sweep
from kvfunc.cli._trace import Trace, TraceRequest, load_trace, parse_trace_csv, synthetic_trace
from kvfunc.cli._units import format_bytes, parse_bytes


def __getattr__(name: str) -> object:
    # matplotlib takes a while to import: load it only when a plot is asked for.
    if name in ("plot_usage", "plot_sweep"):
        from kvfunc.cli import _plot

        return getattr(_plot, name)
    if name == "plot_disaggregated":
        from kvfunc.cli import _disagg_plot

        return _disagg_plot.plot_disaggregated
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "PRESETS",
    "SIMULATE_DEFAULTS",
    "SIM_LAYOUTS",
    "Budget",
    "CLIError",
    "DeltaLogWriter",
    "DisaggConfig",
    "DisaggResult",
    "GroupPlan",
    "LatencyReport",
    "ModelPreset",
    "OffloadConfig",
    "PlanConfig",
    "PlanReport",
    "PoolUsage",
    "PrefixReport",
    "Quantiles",
    "ReplayFailed",
    "Scheduler",
    "SchedulerConfig",
    "SharedGroupPlan",
    "SharedPlan",
    "SideReport",
    "SimulationConfig",
    "SimulationResult",
    "SweepPoint",
    "SweepResult",
    "TierReport",
    "Trace",
    "TraceRequest",
    "TransferReport",
    "UpperBound",
    "build_parser",
    "build_preset",
    "build_state",
    "default_layout",
    "format_bytes",
    "load_model_file",
    "load_trace",
    "main",
    "model_from_mapping",
    "parse_bytes",
    "parse_trace_csv",
    "plan_model",
    "plot_disaggregated",
    "plot_sweep",
    "plot_usage",
    "preset_names",
    "run_disaggregated",
    "run_simulation",
    "run_sweep",
    "size_blocks",
    "size_shared_blocks",
    "state_content",
    "synthetic_trace",
    "upper_bound",
    "verify_log",
]
