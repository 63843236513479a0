"""The pipeline's machinery: the CLI edge (one error line), content digests, step execution, the zygote."""
