"""`python -m hybridgnn ...`: the `hybridgnn` command, where its script is not on PATH."""

import sys

from hybridgnn.cli.main import main

sys.exit(main())
