"""Reserved for the profiling stage (see shared/DESIGN.md); filled by later work."""
