"""The collective engine (BSP on all-reduce / reduce-scatter + all-gather, overlapping backward)."""
