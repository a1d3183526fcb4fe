import sys

from headrace.app.cli import main

sys.exit(main())
