"""Every exception the frontend lets reach an entry point, importable from one place.

Entry points map these to responses (a 400, a 503, ...) without importing the packages they
come from: only the frontend imports `preprocess`.
"""

from __future__ import annotations

from mmserve.frontend.async_llm import ServerShuttingDown
from mmserve.frontend.chat_parsing import PromptError
from mmserve.frontend.core_client import EngineDeadError
from mmserve.frontend.file_store import FileNotFound
from mmserve.frontend.media_error import MediaError
from mmserve.frontend.tokenizer import TemplateError
from preprocess import ImageError, PreprocessError

__all__ = [
    "EngineDeadError",
    "FileNotFound",
    "ImageError",
    "MediaError",
    "PreprocessError",
    "PromptError",
    "ServerShuttingDown",
    "TemplateError",
]
