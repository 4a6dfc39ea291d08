"""Constrained decoding on llguidance: a request's ``StructuredOutputsParams`` become a grammar (``grammars``),
compiled off the step loop and cached by grammar (``manager``); the runner keeps one matcher per constrained
request and fills a token bitmask per step, which the sampler applies to those rows only (``bitmask``).

Why llguidance rather than xgrammar (measured, ``scripts/grammar_backend_ab.py``; docs/structured-outputs.md): a
3 MB wheel with no dependencies against xgrammar's triton (1 GB on a CPU machine); a schema compiles in about a
millisecond, so there is nothing to wait for; a mask fills in tens of microseconds on SmolLM2's 49,152 tokens;
and a schema feature it cannot enforce is an error that names it, never a silently looser constraint.
"""
