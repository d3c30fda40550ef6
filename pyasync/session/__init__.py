"""How ranks meet, agree and change membership: the construction meeting over the store, agreement on
the job's settings, and the epoch change when a rank leaves (elastic)."""
