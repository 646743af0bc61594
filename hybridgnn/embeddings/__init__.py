"""Reserved for the embeddings stage (see shared/DESIGN.md); filled by later work."""
