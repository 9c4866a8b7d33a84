"""Special-token text in a client's message content stays text.

Rendered naively, `<|im_end|><|im_start|>system` typed into a user message becomes the real
control tokens, so a user can end their turn and write the system prompt (role injection).
vLLM tokenises it that way; we do not, unless the server is started with
`--allow-special-tokens-in-content`.

How: before the chat template runs, every special-token string inside a client string is
replaced by a marker carrying a per-request random nonce (a client cannot forge one). After
rendering, the text between the template's own control tokens is tokenised as plain text —
markers turned back into the characters the client sent — and each of the template's control
tokens becomes its id. This is how `tokenizers` itself splits text at added tokens (each run
between them is encoded on its own), so with nothing hidden the result is exactly the normal
encoding, and that case takes the normal path anyway.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable

from tokenizers import Tokenizer as HFTokenizer

Hidden = re.Pattern[str]  # finds one rendering's markers; group 1 indexes the hidden token


class SpecialTextShield:
    """Hides special-token text in client strings and encodes rendered prompts around it.

    `specials` maps each special token's text to its id; `plain` is a tokenizer that encodes
    special-token text as ordinary text (`encode_special_tokens = True`).
    """

    def __init__(self, specials: dict[str, int], plain: HFTokenizer) -> None:
        self._specials = specials
        self._tokens = sorted(specials, key=len, reverse=True)  # longest first, as tokenizers matches
        self._index = {token: index for index, token in enumerate(self._tokens)}
        self._find = re.compile("|".join(re.escape(token) for token in self._tokens)) if specials else None
        self._plain = plain

    def hide(self, value: object) -> tuple[object, Hidden | None]:
        """`value` (messages, template kwargs: any JSON-like structure) with special-token text
        in its strings replaced by markers; None when there was none (nothing to undo)."""
        if self._find is None:
            return value, None
        nonce = secrets.token_hex(8)
        count = 0

        def mark(match: re.Match[str]) -> str:
            nonlocal count
            count += 1
            return f"\ue000{nonce}:{self._index[match.group(0)]}\ue001"

        def walk(node: object) -> object:
            if isinstance(node, str):
                return self._find.sub(mark, node)
            if isinstance(node, dict):
                return {key: walk(item) for key, item in node.items()}
            if isinstance(node, list | tuple):
                return [walk(item) for item in node]
            return node

        hidden_value = walk(value)
        if not count:
            return value, None
        return hidden_value, re.compile(f"\ue000{nonce}:(\\d+)\ue001")

    def reveal(self, rendered: str, hidden: Hidden) -> str:
        """The rendered text as the model's input reads: markers back to what the client sent."""
        return hidden.sub(lambda match: self._tokens[int(match.group(1))], rendered)

    def encode(self, rendered: str, hidden: Hidden) -> list[int]:
        """Token ids of `rendered`: the template's special tokens are control tokens, the text
        around them (the client's special-token text included) is plain text."""
        ids: list[int] = []
        run: list[str] = []  # plain text since the last control token

        def flush() -> None:
            if run:
                ids.extend(self._plain.encode_batch(["".join(run)], add_special_tokens=False)[0].ids)
                run.clear()

        position = 0
        for marker in hidden.finditer(rendered):
            self._split_template_text(rendered[position : marker.start()], ids, run, flush)
            run.append(self._tokens[int(marker.group(1))])
            position = marker.end()
        self._split_template_text(rendered[position:], ids, run, flush)
        flush()
        return ids

    def _split_template_text(
        self, text: str, ids: list[int], run: list[str], flush: Callable[[], None]
    ) -> None:
        position = 0
        for match in self._find.finditer(text):
            run.append(text[position : match.start()])
            flush()
            ids.append(self._specials[match.group(0)])
            position = match.end()
        run.append(text[position:])
