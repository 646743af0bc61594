"""Offline profiling (`hybridgnn profile`): drive each pipeline near full use, record
(batch PSGS, latency) and fit mean and p99 curves; scheduler/ derives the operating points
and policies from the profile."""
