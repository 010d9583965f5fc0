"""Is the kernel faster: timers, clocks, statistics, the A/B engine, inputs and outputs, GPUs."""
