"""Helpers shared by the test modules: ``core`` (scheduler scenarios, a fake executor), ``runner`` (driving a
ModelRunner by hand), ``checkpoints`` (tiny random HF checkpoints), ``engine`` (prompts and outputs), ``server``
(a real uvicorn on 127.0.0.1)."""
