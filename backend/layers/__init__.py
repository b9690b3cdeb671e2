"""Building blocks of the Llama family, each a small torch module or function."""
