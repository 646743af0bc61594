"""HTTP serving: KServe v2 codec and validation, micro-batcher, engine, lifecycle."""
