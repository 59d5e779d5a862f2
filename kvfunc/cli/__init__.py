"""The ``kvfunc`` command line and the library functions behind it.

``kvfunc plan`` sizes a model's caches for a memory budget, ``kvfunc
simulate`` replays a request trace through a continuous-batching scheduler
built on the pure allocator, and ``kvfunc replay`` verifies a recorded delta
log.  Everything the commands do is a function here, so notebooks can call
the same code::

    from kvfunc.cli import Budget, PlanConfig, build_preset, plan_model
    report = plan_model(build_preset("llama-3-8b"), PlanConfig(Budget(64 * 2**30)))
"""

from kvfunc.cli._args import SIMULATE_DEFAULTS, build_parser
from kvfunc.cli._custom import load_model_file, model_from_mapping
from kvfunc.cli._errors import CLIError
from kvfunc.cli._log import DeltaLogWriter, ReplayFailed, state_content, verify_log
from kvfunc.cli._main import main
from kvfunc.cli._plan import Budget, GroupPlan, PlanConfig, PlanReport, plan_model, size_blocks
from kvfunc.cli._presets import PRESETS, ModelPreset, build_preset, preset_names
from kvfunc.cli._scheduler import Scheduler, SchedulerConfig
from kvfunc.cli._simulate import (
    GroupUsage,
    SimulationConfig,
    SimulationResult,
    build_state,
    run_simulation,
)
from kvfunc.cli._trace import Trace, TraceRequest, load_trace, parse_trace_csv, synthetic_trace
from kvfunc.cli._units import format_bytes, parse_bytes


def __getattr__(name: str) -> object:
    # matplotlib takes a while to import: load it only when the plot is asked for.
    if name == "plot_usage":
        from kvfunc.cli._plot import plot_usage

        return plot_usage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "PRESETS",
    "SIMULATE_DEFAULTS",
    "Budget",
    "CLIError",
    "DeltaLogWriter",
    "GroupPlan",
    "GroupUsage",
    "ModelPreset",
    "PlanConfig",
    "PlanReport",
    "ReplayFailed",
    "Scheduler",
    "SchedulerConfig",
    "SimulationConfig",
    "SimulationResult",
    "Trace",
    "TraceRequest",
    "build_parser",
    "build_preset",
    "build_state",
    "format_bytes",
    "load_model_file",
    "load_trace",
    "main",
    "model_from_mapping",
    "parse_bytes",
    "parse_trace_csv",
    "plan_model",
    "plot_usage",
    "preset_names",
    "run_simulation",
    "size_blocks",
    "state_content",
    "synthetic_trace",
    "verify_log",
]
