"""`python -m jax_moe.cli`: the `jax-moe` command."""

import sys

from jax_moe.cli import main

sys.exit(main())
