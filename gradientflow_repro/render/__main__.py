"""``python -m gradientflow_repro.render FILE.json ...``: each file's Markdown beside it."""

import sys

from gradientflow_repro.render import main

if __name__ == "__main__":
    sys.exit(main())
