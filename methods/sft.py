"""sft — sequential fine-tuning: stage i trains the last checkpoint on task i alone, minimising the
response-token NLL; no buffer, no penalty (the paper's lower bound, and the objective every replay
method trains with)."""
from methods.base import Method, Objective

METHOD = Method()
OBJECTIVE = Objective()
