import sys

from gpuplane.cli import main

sys.exit(main())
