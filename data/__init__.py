"""TRACE data and users' task streams: the task table and manifests, record files, loaders, metrics, replay buffers and
the embedded synthetic benchmark; the write side (atomic outputs) and the errors every package raises."""
