"""The pipeline's machinery: settings and step specs, content digests, step execution and the
zygote, the generation layout, watching a run."""
