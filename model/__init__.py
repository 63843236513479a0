"""Model core: config, transformer, checkpoint I/O, tokenizer, sampler, GGUF import."""
