"""What a run does: data, model, parallelism and training, with no knowledge of Prefect or MLflow."""
