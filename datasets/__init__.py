"""Input pipelines: sources of examples and the input_fn builder that batches them."""

import trainer  # noqa: F401 - first, so that TensorFlow loads without its start-up lines
