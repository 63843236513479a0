"""TRACE data and users' task streams: the task table and manifests (with a script's --task-spec
flag), record files, loaders, metrics, replay buffers and the embedded synthetic benchmark. The
errors every package raises, JSON Lines and the write side (atomic outputs) are common/'s, below
this package."""
