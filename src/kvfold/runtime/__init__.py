"""The runtime: the folded cache, the attention that adds its biases, model loading, budgets and prompts."""
