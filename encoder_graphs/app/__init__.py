"""The captioning application: command line, pipeline, media loading, results file."""
