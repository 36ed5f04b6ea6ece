import sys

from encoder_graphs.cli import main

sys.exit(main())
