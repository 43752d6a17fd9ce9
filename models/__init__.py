"""Models: one file per model, each a gin-configurable ModelFn."""
