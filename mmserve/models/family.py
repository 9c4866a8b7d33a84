"""The model-family interface: what the generic engine asks of one architecture family.

A family is one folder under mmserve/models/ holding everything particular to its
architectures: how config.json folds into its `ModelConfig`, its multimodal processing (which
preprocessing transform with which settings, the tokens an item becomes, the text around them),
its positions, its modules and their checkpoint names. The engine reaches it only through a
`ModelFamily` (registry.py maps Hugging Face `architectures` to families), and each decoder
layer's per-request state is declared in `ModelConfig.layers`, never assumed.

This module and each family's description modules (config, processing, positions, family)
import no torch: the API server builds prompts with a family's processor and never loads a
model. A family's modules are imported by `ModelFamily.model_class`, when a worker builds one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from mmserve.model_config import ModelConfig
    from mmserve.protocol import MultiModalFeature
    from preprocess import GridTHW, ImageTransform, VideoInfo, VideoTransform


class TextTokens(Protocol):
    """What a processor needs of the tokenizer (the frontend's `Tokenizer`)."""

    def token_to_id(self, token: str) -> int: ...

    def encode(self, text: str) -> list[int]: ...


class ProcessedItem(Protocol):
    """What a processor knows of one processed image or video: its content hash, patch grid and
    placeholder count (the transform's), and for a video which frames were taken at what rate."""

    mm_hash: str
    grid_thw: GridTHW
    num_tokens: int
    video_info: VideoInfo | None


@dataclass(frozen=True)
class Placement:
    """One feature of an item: where its placeholder run sits in the item's tokens, and which of
    the item's pixel rows its encoder reads. Most items are one feature; a family may split an
    item (a video into its frames) so that text stands between the parts."""

    offset: int  # first placeholder token, from the start of the item's tokens
    length: int  # placeholder tokens = embeddings
    grid_thw: GridTHW  # the part's patch grid
    rows: tuple[int, int] | None = None  # [start, stop) of the item's pixel rows; None: all
    part: int | None = None  # the feature's mm_hash is "<item's>-<part>" (None: the item's)
    position_step: float = 1.0  # temporal position units per temporal patch (see PromptPositions)


@dataclass(frozen=True)
class Expansion:
    """The tokens one placeholder of the prompt becomes, and the features among them."""

    token_ids: list[int]
    placements: list[Placement] = field(default_factory=list)


class MultiModalProcessor(ABC):
    """How one family's prompts carry images and videos. Built once per frontend from the
    folder's processor files; the generic frontend loads, hashes and preprocesses items (with
    `image_settings` / `video_settings`), finds the placeholder each chat template renders per
    item and replaces it with the family's `Expansion`."""

    image_settings: ImageTransform
    video_settings: VideoTransform | None  # None: the folder has no video processor
    image_placeholder: str  # the text a chat template writes for one image
    image_placeholder_id: int
    video_placeholder: str | None
    video_placeholder_id: int | None

    @abstractmethod
    def expand_image(self, item: ProcessedItem) -> Expansion:
        """The tokens replacing one image's placeholder."""

    @abstractmethod
    def expand_video(self, item: ProcessedItem) -> Expansion:
        """The tokens replacing one video's placeholder."""


class PromptPositions:
    """Position ids of a prompt's tokens, in `rows` rows (1: the token index for RoPE; 3: M-RoPE's
    temporal, height and width). Computed by the worker when a request arrives."""

    rows: int = 1

    def of_prompt(
        self, num_prompt_tokens: int, features: Sequence[MultiModalFeature]
    ) -> tuple[np.ndarray | None, int]:
        """(positions [rows, num_prompt_tokens] int64, or None where every token's position is
        its index; delta): the token at index i past the table has position i + delta in every
        row. The table need only cover the prompt up to its last item's end."""
        return None, 0


@dataclass(frozen=True)
class FolderConfig:
    """A model folder's config.json, with what every family's config takes from it resolved
    alike (registry.load_model_config): the dtype, the context length, the EOS ids."""

    path: Path
    raw: dict[str, Any]  # config.json
    architecture: str  # `architectures[0]` (or the model_type where a folder names none)
    dtype: str  # the checkpoint's for "auto", else the asked one (one of model_config.DTYPES)
    max_model_len: int  # asked, else the model's max_position_embeddings
    eos_token_ids: tuple[int, ...]
    processor_kwargs: dict[str, Any]  # --mm-processor-kwargs (keys checked against the family's)

    def common_fields(self, family: str) -> dict[str, Any]:
        """The ModelConfig fields resolved here, as keyword arguments."""
        return {
            "path": self.path,
            "architecture": self.architecture,
            "family": family,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "eos_token_ids": self.eos_token_ids,
        }


class ModelFamily(ABC):
    """One family of architectures, as the engine sees it."""

    name: str  # the folder's name under mmserve/models/
    architectures: tuple[str, ...]  # config.json `architectures[0]` values it serves
    processor_kwargs: tuple[str, ...] = ()  # the --mm-processor-kwargs keys it takes

    @abstractmethod
    def model_config(self, folder: FolderConfig) -> ModelConfig:
        """The folder's configuration as this family's ModelConfig (ValueError for what it
        cannot serve)."""

    @abstractmethod
    def multimodal_processor(
        self, config: ModelConfig, tokens: TextTokens, processor_kwargs: dict[str, Any]
    ) -> MultiModalProcessor:
        """The processor of prompts for the folder at `config.path`; `processor_kwargs`
        (--mm-processor-kwargs, keys among `processor_kwargs`) override its settings."""

    def prompt_positions(self, config: ModelConfig) -> PromptPositions:
        """The family's positions (default: each token's index)."""
        return PromptPositions()

    @abstractmethod
    def model_class(self) -> type:
        """The nn.Module class a worker builds (imports the family's modules, and torch):
        `cls(config, encoder_data_parallel)`; see loader.py for its interface."""
