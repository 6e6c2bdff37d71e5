"""`python -m vitrain` is the `vitrain` command (this is what torchrun launches)."""

import sys

from vitrain.cli import main

sys.exit(main())
