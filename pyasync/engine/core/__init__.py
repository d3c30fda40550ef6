"""What both engines share: the round machine and its rules, shards and buckets, gradient capture,
clipping, the clock, stats, failure reports, streams, checkpoint access and compressed replies."""
