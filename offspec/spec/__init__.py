"""The speculative decoding algorithm: trees, drafters, verification, the engine and the model runner."""
