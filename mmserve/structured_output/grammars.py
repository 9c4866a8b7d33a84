"""A request's StructuredOutputsParams as an xgrammar grammar.

JSON grammars are compiled without free whitespace (one line, `, ` and `: ` separators): a
model that favours whitespace, or a random-weight one, could otherwise fill its whole answer
with it. JSON schemas are strict (no properties or items the schema does not name), which
keeps every answer valid under the schema whether or not the client asked for strict.

xgrammar is imported inside the functions: it pulls in transformers, which the processes that
never see a structured request should not pay for.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from mmserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def check_grammar(spec: StructuredOutputsParams) -> None:
    """Raise ValueError (naming the spec) if `spec` does not make a grammar; no tokenizer needed."""
    import xgrammar as xgr

    kind, text = spec.key
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(spec.choice or []))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(text)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"invalid structured_outputs {kind}: {_first_line(e)}") from None


def compile_grammar(
    compiler: xgrammar.GrammarCompiler, spec: StructuredOutputsParams
) -> xgrammar.CompiledGrammar:
    kind, text = spec.key
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(spec.choice or []))
    if kind == "grammar":
        return compiler.compile_grammar(text)
    return compiler.compile_structural_tag(text)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "


def _first_line(error: Exception) -> str:
    text = _LOG_PREFIX.sub("", str(error).strip())
    return text.splitlines()[0][:300] if text else type(error).__name__
