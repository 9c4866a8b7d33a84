"""The model folder's tokenizer and chat template, without transformers at run time.

tokenizer.json is read by the `tokenizers` library; the chat template (tokenizer_config.json,
chat_template.json or chat_template.jinja) is rendered with a sandboxed Jinja environment
configured as Hugging Face renders templates (trim_blocks, lstrip_blocks, `raise_exception`).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from mmserve.frontend.special_text import SpecialTextShield


class TemplateError(ValueError):
    """The chat template refused the messages (e.g. an unsupported role order)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        """`chat_template` (Jinja source) replaces the folder's template, as vLLM's --chat-template."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(tokenizer_file))
        config_file = model_dir / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = {
            t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        plain = HFTokenizer.from_str(self._tok.to_str())
        plain.encode_special_tokens = True  # special-token text is encoded as ordinary text
        self.shield = SpecialTextShield(self.special_token_ids, plain)
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self._tok.token_to_id(eos) if eos else None
        template = chat_template or _load_chat_template(model_dir, self.config)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
        self._template = env.from_string(template) if template else None
        self._template_source = template or ""

    def token_to_id(self, token: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the tokenizer has no token {token!r}")
        return token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. `encode_batch` lets the GIL go while it works; `encode` holds
        it (~0.3 s for a 260 K-character prompt, during which no other thread runs)."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._tok, skip_special_tokens)

    def chat_template_mentions(self, name: str) -> bool:
        """Whether the chat template's source uses `name` (e.g. "tools": it renders tools itself)."""
        return name in self._template_source

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self._template is None:
            raise TemplateError("this model folder has no chat template")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {e}") from e


class IncrementalDetokenizer:
    """Text appended by each new token; bytes of an unfinished UTF-8 character wait for the next."""

    def __init__(self, tok: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok, token_id) or ""


def _load_chat_template(model_dir: Path, config: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        return json.loads(json_file.read_text()).get("chat_template")
    return config.get("chat_template")
