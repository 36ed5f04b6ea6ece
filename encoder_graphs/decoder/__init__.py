"""The language model's decode step as CUDA graphs: runner, static cache, sampling, and which
`generate` calls it takes."""
