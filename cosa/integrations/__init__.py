"""Integrations of CoSA with model libraries. ``cosa.integrations.transformers`` (Hugging Face
transformers) is imported on demand, so that ``cosa`` itself never needs transformers installed."""
