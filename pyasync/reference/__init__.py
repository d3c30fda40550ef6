"""Pure-torch version of every op in :mod:`pyasync.ops`: the specification and the test oracle."""
