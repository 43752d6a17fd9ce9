"""Input pipelines: sources of examples and the input_fn builder that batches them."""
