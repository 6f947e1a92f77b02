"""`python -m batonlm.bench ...`: the load generator without the `batonlm` CLI."""

import sys

from batonlm.bench.cli import main

sys.exit(main())
