"""How ranks meet, agree and change membership: the construction meeting over the store (meet.py) and the
startup handshake built on it (bootstrap.py), agreement on the job's settings (agree.py), the membership
epoch as a record with its engine (epoch.py), and the epoch change when a rank leaves (membership.py,
elastic)."""
