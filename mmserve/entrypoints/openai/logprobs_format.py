"""Logprobs in OpenAI's two shapes (chat's `content` list, completions' parallel lists), and
vLLM's `prompt_logprobs`."""

from __future__ import annotations

from mmserve.outputs import CompletionOutput, Logprob, PromptLogprobs


def chat_logprobs(completion: CompletionOutput, top_k: int) -> dict | None:
    """OpenAI chat logprobs of the completion's tokens: each one and its top_k alternatives."""
    if completion.logprobs is None or not completion.token_ids:
        return None
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        top = sorted(
            (logprob for logprob in entry.values() if logprob.rank is not None and logprob.rank <= top_k),
            key=lambda logprob: logprob.rank,
        )
        content.append(
            {
                **_token_logprob(entry[token_id]),
                "top_logprobs": [_token_logprob(alternative) for alternative in top],
            }
        )
    return {"content": content}


def _token_logprob(logprob: Logprob) -> dict:
    token = logprob.decoded_token
    return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode())}


def completion_logprobs(completion: CompletionOutput) -> dict | None:
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top = [], [], []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        sampled = entry[token_id]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        top.append({logprob.decoded_token: logprob.logprob for logprob in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": []}


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
