"""Engine layer: the step loop (LLMEngine), the offline API (LLM), detokenization and outputs."""
