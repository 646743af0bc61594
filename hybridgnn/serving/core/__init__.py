"""The serving engine and what it runs beside its pipelines: admission, batching, dispatch,
completion and lifecycle; lookups, new nodes and graph updates. No transport code."""
