import sys

from jserve.cli import main

sys.exit(main())
