"""Whether a request could ever be scheduled: checked once when it arrives, so that a request
the engine can never run is refused with a reason instead of waiting forever."""

from __future__ import annotations

from mmserve.core.request import Request


def check_schedulable(
    request: Request, *, max_model_len: int, encoder_item_limit: int, block_size: int, num_blocks: int
) -> None:
    """Raise ValueError, naming the limit, if `request` cannot fit: an empty prompt, a prompt with
    no room left for one generated token, an image or video larger than the encoder budget or
    cache allows per item (`encoder_item_limit` tokens), or more KV blocks than the cache has."""
    if request.num_prompt_tokens == 0:
        raise ValueError("the prompt is empty")
    if request.num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {request.num_prompt_tokens} tokens, but the model's context length is "
            f"{max_model_len} (room is needed for at least one generated token)"
        )
    for f in request.mm_features:
        if f.length > encoder_item_limit:
            raise ValueError(
                f"an {f.modality} needs {f.length} tokens, more than the encoder budget/cache allows "
                f"per item ({encoder_item_limit}); raise them or send a smaller {f.modality}"
            )
    if -(-(request.num_prompt_tokens + 1) // block_size) > num_blocks:
        raise ValueError(f"the prompt needs more KV blocks than the cache holds ({num_blocks})")
