"""Runtime: audio I/O, the offline turn, and (per session) RNG state."""
