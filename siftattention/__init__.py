"""SiftAttention: power-law guided dynamic sifting of attention for LLM decoding."""
