"""Integrations of CoSA with model libraries, each imported on demand so that ``cosa`` itself never
needs them installed: ``cosa.integrations.transformers`` (Hugging Face transformers) and
``cosa.integrations.vllm_plugin`` / ``vllm_backend`` (vLLM's V1 engine, docs/vllm.md)."""
