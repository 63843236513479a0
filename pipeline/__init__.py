"""The pipeline's machinery: settings and step specs, content digests, step execution and the zygote, the generation
layout and the cost model the planner prices with, a training stage's resumable state, watching a run."""
