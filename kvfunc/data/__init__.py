"""Data shipped with kvfunc: request traces and their attributions.

* ``code`` / ``conv``: the first 3,000 rows of the code and conversation
  traces of the Azure LLM inference trace 2023 (Azure Public Dataset,
  CC-BY-4.0).
* ``mooncake-conversation`` / ``mooncake-synthetic``: the conversation and
  synthetic request traces of Mooncake (Qin et al., FAST 2025), whole and
  gzip-compressed, under the Apache License 2.0 (its text ships beside them
  as ``mooncake_LICENSE-APACHE.txt``).

``ATTRIBUTION.md`` gives the source, the licence and the citation of each.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

__all__ = ["MOONCAKE_TRACES", "TRACE_SAMPLES", "attribution", "mooncake_license",
           "mooncake_trace", "trace_sample"]

#: Trace name -> packaged file (CSV with the Azure columns).
TRACE_SAMPLES: dict[str, str] = {
    "code": "azure_llm_inference_2023_code_sample.csv",
    "conv": "azure_llm_inference_2023_conv_sample.csv",
}

#: Trace name -> packaged file (gzip-compressed JSON lines with 512-token block hash ids).
MOONCAKE_TRACES: dict[str, str] = {
    "mooncake-conversation": "mooncake_conversation_trace.jsonl.gz",
    "mooncake-synthetic": "mooncake_synthetic_trace.jsonl.gz",
}


def trace_sample(name: str) -> Traversable:
    """The packaged sample of trace ``name`` (``"code"`` or ``"conv"``).

    >>> trace_sample("conv").name
    'azure_llm_inference_2023_conv_sample.csv'
    """
    return resources.files(__name__).joinpath(TRACE_SAMPLES[name])


def mooncake_trace(name: str) -> Traversable:
    """The packaged Mooncake trace ``name`` (a key of :data:`MOONCAKE_TRACES`).

    >>> mooncake_trace("mooncake-conversation").name
    'mooncake_conversation_trace.jsonl.gz'
    """
    return resources.files(__name__).joinpath(MOONCAKE_TRACES[name])


def attribution() -> str:
    """The text of ``ATTRIBUTION.md`` (sources, licences, citations).

    >>> "CC-BY-4.0" in attribution(), "Apache License 2.0" in attribution()
    (True, True)
    """
    return resources.files(__name__).joinpath("ATTRIBUTION.md").read_text(encoding="utf-8")


def mooncake_license() -> str:
    """The Apache License 2.0 text the Mooncake traces ship under.

    >>> mooncake_license().split()[:3]
    ['Apache', 'License', 'Version']
    """
    path = resources.files(__name__).joinpath("mooncake_LICENSE-APACHE.txt")
    return path.read_text(encoding="utf-8")
