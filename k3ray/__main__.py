"""`python -m k3ray ...`: the `k3ray` command without its console script."""
import sys

from k3ray.control.cli import main

sys.exit(main())
