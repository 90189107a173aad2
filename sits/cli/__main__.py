"""``python -m sits.cli``: how tests and benchmarks start servers without the installed script."""

import sys

from sits.cli import main

sys.exit(main())
