"""Data shipped with kvfunc: a sample of the Azure LLM inference trace 2023.

The two CSV files are the first 3,000 rows of the code and conversation
traces of the Azure Public Dataset, licensed CC-BY-4.0; ``ATTRIBUTION.md``
beside them gives the source, the licence and the citation.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

__all__ = ["TRACE_SAMPLES", "attribution", "trace_sample"]

#: Trace name -> packaged file.
TRACE_SAMPLES: dict[str, str] = {
    "code": "azure_llm_inference_2023_code_sample.csv",
    "conv": "azure_llm_inference_2023_conv_sample.csv",
}


def trace_sample(name: str) -> Traversable:
    """The packaged sample of trace ``name`` (``"code"`` or ``"conv"``).

    >>> trace_sample("conv").name
    'azure_llm_inference_2023_conv_sample.csv'
    """
    return resources.files(__name__).joinpath(TRACE_SAMPLES[name])


def attribution() -> str:
    """The text of ``ATTRIBUTION.md`` (source, licence, citation).

    >>> "CC-BY-4.0" in attribution()
    True
    """
    return resources.files(__name__).joinpath("ATTRIBUTION.md").read_text(encoding="utf-8")
