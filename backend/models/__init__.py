"""Model definitions. Every model runs over one flat batch of tokens from many sequences."""
