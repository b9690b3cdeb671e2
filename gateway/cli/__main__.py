"""`python -m gateway.cli`: the `tollgate` command."""

import sys

from gateway.cli import main

sys.exit(main())
