"""Offline profiling: drive each pipeline near full use, record (batch PSGS, latency), fit mean and p99 curves, derive the operating points and plot them (`hybridgnn profile`)."""
