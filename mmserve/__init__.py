"""mmserve: a serving engine for vision-language models.

`from mmserve import LLM, SamplingParams` gives the offline API; the engine loads lazily so that
importing the package stays cheap for the API server and tools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmserve.entrypoints.llm import LLM

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from mmserve.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'mmserve' has no attribute {name!r}")
