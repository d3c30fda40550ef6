"""``python -m pyasync.demo``: see ``pyasync.demo.cli`` and docs/demo.md."""

import sys

from pyasync.demo.cli import cli

if __name__ == "__main__":
    sys.exit(cli())
