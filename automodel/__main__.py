import sys

from automodel.cli import main

sys.exit(main())
