"""The Ollama API (``/api/chat``, ``/api/generate``, ``/api/tags``, ...), an adapter over the chat path."""
