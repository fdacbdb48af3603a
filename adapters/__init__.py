"""Framework adapters (installed as `mas_trainer.adapters`; LangGraph first)."""
