"""The OpenAI Responses API (``/v1/responses``), an adapter over the chat path with a store of past responses."""
