import sys

from parse_jax.cli.main import main

sys.exit(main())
