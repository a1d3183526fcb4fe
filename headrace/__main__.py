import sys

from headrace.engine.cli import main

sys.exit(main())
