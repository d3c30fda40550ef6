"""The point-to-point engine (ASP, SSP, Quorum, and BSP with compressed replies): each rank pushes its
gradient shards to their owners and owners apply them and reply (docs/architecture.md)."""
