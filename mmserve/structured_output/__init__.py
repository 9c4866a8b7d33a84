"""Structured outputs with xgrammar: grammars from request specs (grammars.py), compiled off
the engine loop and kept per request on the EngineCore side (manager.py).

Imports only the leaves: the API side validates specs with it, the engine wiring hands the
manager to the scheduler, which knows it only through `core.grammar.GrammarTracker`.
"""
