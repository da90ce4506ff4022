"""Thin Prefect tasks: each calls model_core, records to MLflow, and returns a small typed result."""
