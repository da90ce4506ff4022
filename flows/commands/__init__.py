"""One module per `llmflow` command: its arguments (`register`) beside its handler (`run`)."""
