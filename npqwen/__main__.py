"""`python -m npqwen ...` is the `npqwen` command."""
import sys

from .cli import main

sys.exit(main())
