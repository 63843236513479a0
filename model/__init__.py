"""Model core: config, transformer, checkpoint I/O, tokenizer, GGUF import; the cost model of a step
(costs.py: GPU-hours, FSDP2 memory per GPU) and a training stage's resumable state (train_state.py).
Sampling from a model is engine/'s, which imports this package; nothing here imports engine/."""
