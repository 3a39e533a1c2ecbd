"""Measurement in one place: timing, the FLOP model, NVTX/record ranges, profiler summaries, memory timelines."""
