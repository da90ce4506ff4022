"""The pipelines as Prefect flows, and the `llmflow` command line that runs them."""
