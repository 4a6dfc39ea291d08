"""Model building blocks: rotary embedding, norms, activations, and the paged attention backends."""
