import sys

from encoder_graphs.app.cli import main

sys.exit(main())
