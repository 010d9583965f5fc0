"""pytest wiring for A/B speed comparisons (``--kernel-ab``); placeholder until the A/B engine lands."""
