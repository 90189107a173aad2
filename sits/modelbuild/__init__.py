"""Building model directories offline: tests, benchmarks and ``sits model build-tiny`` need a real
model and these machines cannot reach a hub. Not part of the engine: it uses the engine's model code
to save weights, and nothing in ``sits.engine`` imports it."""
