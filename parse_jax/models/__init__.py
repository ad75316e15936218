"""The Flax decoder family (Llama-3, Qwen2/2.5, Qwen3): config, decoder, KV cache, `Model`, tokenizer, padded
vocabularies, and the sharding rules of their params. Reading and writing model files is `parse_jax.checkpoints`."""
