import sys

from pulsenet.cli import main

sys.exit(main())
